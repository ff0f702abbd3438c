//! The memory functions the compiler may call (there is no libc). `rep
//! movsb`/`rep stosb` are fast on CPUs with ERMSB and cannot be turned back
//! into calls to themselves by the optimizer.

use core::arch::asm;

/// # Safety
/// As C `memcpy`.
#[no_mangle]
pub unsafe extern "C" fn memcpy(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    asm!(
        "rep movsb",
        inout("rcx") n => _,
        inout("rdi") dest => _,
        inout("rsi") src => _,
        options(nostack, preserves_flags),
    );
    dest
}

/// # Safety
/// As C `memmove`.
#[no_mangle]
pub unsafe extern "C" fn memmove(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dest as usize).wrapping_sub(src as usize) >= n {
        // No overlap that a forward copy would clobber.
        return memcpy(dest, src, n);
    }
    // Backward copy.
    asm!(
        "std",
        "rep movsb",
        "cld",
        inout("rcx") n => _,
        inout("rdi") dest.wrapping_add(n).wrapping_sub(1) => _,
        inout("rsi") src.wrapping_add(n).wrapping_sub(1) => _,
        options(nostack),
    );
    dest
}

/// # Safety
/// As C `memset`.
#[no_mangle]
pub unsafe extern "C" fn memset(dest: *mut u8, c: i32, n: usize) -> *mut u8 {
    asm!(
        "rep stosb",
        inout("rcx") n => _,
        inout("rdi") dest => _,
        in("al") c as u8,
        options(nostack, preserves_flags),
    );
    dest
}

/// # Safety
/// As C `memcmp`.
#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    // Eight bytes at a time while they are equal (chanbench compares every
    // message in full: a byte loop held its streaming down), then the bytes
    // of the first differing word, or the tail.
    while i + 8 <= n {
        let x = a.add(i).cast::<u64>().read_unaligned();
        let y = b.add(i).cast::<u64>().read_unaligned();
        if x != y {
            break;
        }
        i += 8;
    }
    while i < n {
        let (x, y) = (*a.add(i), *b.add(i));
        if x != y {
            return i32::from(x) - i32::from(y);
        }
        i += 1;
    }
    0
}

/// # Safety
/// As C `bcmp`.
#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    memcmp(a, b, n)
}
