import sys,glob,re,os,collections
d=sys.argv[1]
fs=sorted(glob.glob(d+'/*.sched'),key=lambda p:int(p.rsplit('-',1)[1].split('.')[0]))
def parse(p):
    r={}
    for l in open(p):
        v=l.split()
        if len(v)<6: continue
        r[v[0]+'#'+str(len([k for k in r if k.startswith(v[0]+'#')]))]=list(map(int,v[1:6]))
    return r
start=None
rows=[]
for p in fs:
    b=os.path.basename(p); arm=b.split('-')[3]
    if '-start-' in b: start=parse(p); continue
    z=parse(p); g=collections.defaultdict(lambda:[0]*5)
    for k,v in z.items():
        a=start.get(k,[0]*5)
        name=re.sub(r'\d+','N',k.split('#')[0])
        for i in range(5): g[name][i]+=v[i]-a[i]
    rows.append((arm,g));print(arm, ' | '.join(f'{n}: run {v[0]/1e6:.0f}ms wait {v[1]/1e6:.0f}ms slices {v[2]} vol {v[3]} invol {v[4]}' for n,v in sorted(g.items()) if v[0]>5e6))

import statistics as st
for arm in ('private','shared'):
    gs=[g for a,g in rows if a==arm]
    names=sorted(set(n for g in gs for n in g))
    print(arm, ' | '.join(f"{n}: run {st.mean(g[n][0] for g in gs)/1e6:.0f} wait {st.mean(g[n][1] for g in gs)/1e6:.0f} slices {st.mean(g[n][2] for g in gs):.0f}" for n in names))
