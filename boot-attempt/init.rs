//! A tiny static /init for a Linux boot attempt: prints a marker line to
//! the console and reboots (with `reboot=k` the i8042 reset ends the VM).
#![no_std]
#![no_main]

use core::arch::asm;

const MSG: &[u8] = b"\nNINELIVES-INIT: user space reached, pid 1 powering off\n";

unsafe fn syscall4(n: usize, a: usize, b: usize, c: usize, d: usize) -> usize {
    let ret;
    // SAFETY: a raw Linux system call; arguments are plain integers or
    // pointers to static data.
    unsafe {
        asm!("syscall", inlateout("rax") n => ret, in("rdi") a, in("rsi") b,
             in("rdx") c, in("r10") d, out("rcx") _, out("r11") _, options(nostack));
    }
    ret
}

#[unsafe(no_mangle)]
pub extern "C" fn _start() -> ! {
    // SAFETY: system calls with integer arguments and pointers to static,
    // NUL-terminated or length-delimited data.
    unsafe {
        // open("/dev/console", O_WRONLY) in case fd 1 is not set up.
        let fd = syscall4(2, c"/dev/console".as_ptr() as usize, 1, 0, 0);
        let fd = if (fd as isize) < 0 { 1 } else { fd };
        syscall4(1, fd, MSG.as_ptr() as usize, MSG.len(), 0);
        syscall4(162, 0, 0, 0, 0); // sync
        // reboot(MAGIC1, MAGIC2, LINUX_REBOOT_CMD_POWER_OFF)
        syscall4(169, 0xfee1dead, 0x28121969, 0x4321fedc, 0);
        // If power-off only halted: restart (i8042 reset with reboot=k).
        syscall4(169, 0xfee1dead, 0x28121969, 0x01234567, 0);
    }
    loop {}
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}
