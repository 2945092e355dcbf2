//! A cap on the vector instructions every CPU kernel may use, below what the CPU has: to run
//! (and measure, and test) the AVX2 or portable paths on an AVX-512 machine
//! (`SGL_CPU_ISA`, sglite.env). The kernels still ask the CPU; this only says no more often.

use std::sync::atomic::{AtomicU8, Ordering};

/// The levels, lowest first: portable code, AVX2 (+FMA, F16C), AVX2 with AVX-VNNI, AVX-512.
pub const LEVELS: [&str; 4] = ["scalar", "avx2", "avx2vnni", "avx512"];

/// The widest allowed (an index into `LEVELS`; the default: no cap).
static LEVEL: AtomicU8 = AtomicU8::new(3);

/// Cap the kernels at `LEVELS[level]`.
pub fn set_level(level: u8) {
    LEVEL.store(level.min(3), Ordering::Relaxed);
}

pub fn level() -> u8 {
    LEVEL.load(Ordering::Relaxed)
}

/// Whether AVX-512 code may run (the CPU must still have it).
pub fn avx512() -> bool {
    level() >= 3
}

/// Whether AVX-VNNI code may run.
pub fn avx_vnni() -> bool {
    level() >= 2
}

/// Whether AVX2 code may run (the CPU must still have it).
pub fn avx2() -> bool {
    level() >= 1
}
