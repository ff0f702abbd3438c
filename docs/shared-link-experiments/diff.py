import sys,re,glob,os
d=sys.argv[1]
def parse(p):
    t=open(p).read(); r={}
    sec=None; lines=t.split('\n')
    cur=None
    for i,l in enumerate(lines):
        m=re.match(r'\d+: (\S+?):',l)
        if m: cur=m.group(1)
        if cur and cur.startswith('nltap'):
            if l.strip().startswith('RX:') and 'bytes' in l:
                v=lines[i+1].split(); r[cur+'.rxp']=int(v[1]); r[cur+'.rxdrop']=int(v[3])
            if l.strip().startswith('TX:') and 'bytes' in l:
                v=lines[i+1].split(); r[cur+'.txp']=int(v[1]); r[cur+'.txdrop']=int(v[3])
        m=re.match(r'qdisc (\S+) \S+ dev (\S+)',l)
        if m and m.group(2).startswith('nltap'):
            v=lines[i+1]; mm=re.search(r'Sent \d+ bytes (\d+) pkt \(dropped (\d+), overlimits \d+ requeues (\d+)',v)
            q=m.group(2); r[q+'.qsent']=int(mm.group(1)); r[q+'.qdrop']=int(mm.group(2)); r[q+'.qreq']=int(mm.group(3))
        m=re.match(r'(Udp\w+|Ip\w+)\s+(\d+)',l)
        if m and m.group(1) in ('UdpInDatagrams','UdpOutDatagrams','UdpRcvbufErrors','UdpSndbufErrors','IpOutDiscards','UdpInErrors','UdpMemErrors'): r[m.group(1)]=int(m.group(2))
    sn=t.split('== softnet')[1].split('== loadavg')[0].strip().split('\n')
    for c,row in enumerate(sn):
        v=row.split()
        r[f'sn{c}.proc']=int(v[0],16); r[f'sn{c}.drop']=int(v[1],16); r[f'sn{c}.squeeze']=int(v[2],16)
    return r
files=sorted(glob.glob(d+'/*.txt'),key=lambda p:int(p.rsplit('-',1)[1][:-4]))
starts={}
for p in files:
    b=os.path.basename(p); m=re.match(r'(.*)-k(\d+)-(start|stop)-\d+',b)
    key=(m.group(1),m.group(2))
    if m.group(3)=='start': starts[key]=parse(p)
    else:
        a=starts.pop(key); z=parse(p)
        dd={k:z[k]-a.get(k,0) for k in z if z[k]-a.get(k,0)!=0}
        print(m.group(1).split('-')[2],'k'+m.group(2),' '.join(f'{k}={v}' for k,v in sorted(dd.items())))
