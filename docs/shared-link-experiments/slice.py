import ctypes,sys,struct
libc=ctypes.CDLL(None,use_errno=True)
ns=int(sys.argv[1])
for tid in sys.argv[2:]:
    attr=struct.pack('IIQiIQQQII',56,0,0,0,0,ns,0,0,0,0)
    buf=ctypes.create_string_buffer(attr,56)
    r=libc.syscall(314,int(tid),buf,0)
    if r!=0: print('fail',tid,ctypes.get_errno())
