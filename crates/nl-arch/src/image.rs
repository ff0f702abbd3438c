//! Loading the guest's ELF images (linux-loader) into fixed, bounded ranges.
//!
//! Each image is loaded through a window of guest memory that covers only the
//! range it may occupy, so an image with segments elsewhere (or one too big)
//! is refused instead of overwriting page tables or another image.

use std::io::Cursor;

use linux_loader::loader::{elf::Elf, KernelLoader};
use vm_memory::GuestAddress;

use crate::ArchError;

/// Where an image was loaded.
#[derive(Clone, Copy, Debug)]
pub struct Loaded {
    pub entry: u64,
    pub end: u64,
}

/// Loads the ELF `image` (named `what` in errors) into `[start, end)`.
pub fn load_elf(
    mem: &nl_memory::GuestMemory,
    what: &'static str,
    image: &[u8],
    start: u64,
    end: u64,
) -> Result<Loaded, ArchError> {
    if image.len() < 4 || &image[..4] != b"\x7fELF" {
        return Err(ArchError::BadElf { what, why: "missing ELF magic".into() });
    }
    let window = mem.window(start, end - start).map_err(|e| ArchError::ImageDoesNotFit {
        what,
        start,
        end,
        why: e.to_string(),
    })?;
    let res = Elf::load(&window, None, &mut Cursor::new(image), Some(GuestAddress(start)))
        .map_err(|e| {
            let why = e.to_string();
            if why.contains("Unable to read kernel image") || why.contains("entry") {
                ArchError::ImageDoesNotFit { what, start, end, why }
            } else {
                ArchError::BadElf { what, why }
            }
        })?;
    let entry = res.kernel_load.0;
    if res.kernel_end > end || entry >= end {
        return Err(ArchError::ImageDoesNotFit {
            what,
            start,
            end,
            why: format!("image ends at {:#x}, entry {entry:#x}", res.kernel_end),
        });
    }
    Ok(Loaded { entry, end: res.kernel_end })
}
