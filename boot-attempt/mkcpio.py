# newc cpio: /dev, /dev/console, /init (same layout as tests/linux.rs initramfs()).
import sys
out = bytearray()
def entry(ino, name, mode, rdev, data):
    global out
    hdr = "070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x" % (
        ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name) + 1, 0)
    out += hdr.encode() + name.encode() + b"\0"
    while len(out) % 4: out += b"\0"
    out += data
    while len(out) % 4: out += b"\0"
entry(1, "dev", 0o040755, (0, 0), b"")
entry(2, "dev/console", 0o020600, (5, 1), b"")
entry(3, "init", 0o100755, (0, 0), open(sys.argv[1], "rb").read())
entry(0, "TRAILER!!!", 0, (0, 0), b"")
open(sys.argv[2], "wb").write(out)
