import sys,glob,re,os,collections
d=sys.argv[1]
# pair .thr files with diff of UdpInDatagrams (same order)
thr=sorted(glob.glob(d+'/*.thr'),key=lambda p:int(p.rsplit('-',1)[1][:-4]))
for p in thr:
    arm=os.path.basename(p).split('-')[3]
    g=collections.Counter()
    for l in open(p):
        m=re.match(r'\s*(\S+)-(\d+)\s+([\d.,]+)\s+msec',l)
        if m:
            name=re.sub(r'\d+','N',m.group(1)); g[name]+=float(m.group(3).replace(',',''))
    print(arm, ' '.join(f'{k}={v:.0f}' for k,v in sorted(g.items()) if v>5), 'total=%.0f'%sum(g.values()))
