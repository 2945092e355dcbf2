//! Where the kernel's second (third, ...) thread comes from.
//!
//! torch runs its CPU ops on an OpenMP team whose workers keep spinning for a while after
//! each op, waiting for the next one. A thread of our own started right after a torch op
//! finds the other cores held by those spinners and waits for the scheduler: on 2 cores the
//! kernel then ran on one core, at 1.8 ms a layer instead of 1.0 ms (16 rows x 1150 keys).
//! So when the host registers its OpenMP runtime's `GOMP_parallel` (`set_openmp_parallel`;
//! the Python launcher finds the one torch loaded), parallel work runs on that very team,
//! whose spinning workers pick it up at once. Without it, on scoped threads.

use std::ffi::{c_uint, c_void};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;

use crate::contention;

/// libgomp's `void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads,
/// unsigned flags)`: runs `fn(data)` on every thread of a team of `num_threads` (the caller
/// included) and returns when all are done.
type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);

static GOMP_PARALLEL: AtomicUsize = AtomicUsize::new(0);

/// Run parallel work on the OpenMP team of `addr`, the address of `GOMP_parallel` (libgomp's,
/// or a runtime with its ABI, such as LLVM's or Intel's); 0 goes back to scoped threads.
///
/// # Safety
/// `addr` must be 0 or that function's address in a library that stays loaded.
pub unsafe fn set_openmp_parallel(addr: usize) {
    GOMP_PARALLEL.store(addr, Ordering::Release);
}

/// Calls `work(i)` exactly once for each `i` in `0..n`, on at most `threads` threads (this one
/// included), which take the next index as they finish the last. Returns when all are done;
/// a panic in `work` is raised again here once every thread has stopped.
pub fn for_each(n: usize, threads: usize, work: &(dyn Fn(usize) + Sync)) {
    let threads = contention::allowed(threads).min(n);
    if threads <= 1 {
        (0..n).for_each(work);
        return;
    }
    let next = AtomicUsize::new(0);
    on_team(threads, &|_| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        work(i);
    });
}

/// As `for_each`, but each thread first takes a contiguous share of `0..n` (an equal one),
/// front to back, and only then helps with the others' shares from their backs. For work
/// that streams memory in index order: each thread reads one run of addresses, which the
/// hardware prefetchers follow, instead of a chunk every other one (a 7B's decode matmuls
/// read their weights at 44-52 GB/s this way, 39-43 taking the next index; the same
/// machine, runs alternated), and a thread that falls behind is still helped at the end.
pub fn for_each_streamed(n: usize, threads: usize, work: &(dyn Fn(usize) + Sync)) {
    let threads = contention::allowed(threads).min(n);
    if threads <= 1 || n > u32::MAX as usize {
        return for_each(n, threads, work);
    }
    // share s: the indices lo..hi still to take, as (lo << 32) | hi
    let pack = |lo: usize, hi: usize| ((lo as u64) << 32) | hi as u64;
    let shares: Vec<AtomicU64> = (0..threads)
        .map(|s| AtomicU64::new(pack(n * s / threads, n * (s + 1) / threads)))
        .collect();
    let take = |share: &AtomicU64, front: bool| -> Option<usize> {
        let mut cur = share.load(Ordering::Relaxed);
        loop {
            let (lo, hi) = ((cur >> 32) as usize, (cur & 0xffff_ffff) as usize);
            if lo >= hi {
                return None;
            }
            let (next, i) = if front {
                (pack(lo + 1, hi), lo)
            } else {
                (pack(lo, hi - 1), hi - 1)
            };
            match share.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(i),
                Err(now) => cur = now,
            }
        }
    };
    on_team(threads, &|me| {
        while let Some(i) = take(&shares[me], true) {
            work(i);
        }
        for k in 1..threads {
            while let Some(i) = take(&shares[(me + k) % threads], false) {
                work(i);
            }
        }
    });
}

/// Runs `drain(t)` on `threads` threads (this one included), t = 0, 1, .. in the order they
/// start, and returns when all are done; a panic in one is raised again here after all
/// stop (each `drain` must end on its own: the work left is what the others take).
fn on_team(threads: usize, drain: &(dyn Fn(usize) + Sync)) {
    let joined = AtomicUsize::new(0);
    let panic = Mutex::new(None);
    let (caller, start) = (thread::current().id(), contention::now_ns());
    let caller_done = AtomicU64::new(0);
    let run = || {
        let me = joined.fetch_add(1, Ordering::Relaxed) % threads;
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| drain(me))) {
            panic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(payload);
        }
        if thread::current().id() == caller {
            caller_done.store(contention::now_ns(), Ordering::Relaxed);
        }
    };
    let addr = GOMP_PARALLEL.load(Ordering::Acquire);
    if addr == 0 {
        std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(run);
            }
            run();
        });
    } else {
        extern "C" fn trampoline(data: *mut c_void) {
            // SAFETY: `data` is the `&dyn Fn()` below, alive until GOMP_parallel returns; no
            // panic crosses this frame (`run` catches them).
            let run = unsafe { &*(data as *const &(dyn Fn() + Sync)) };
            run();
        }
        let run: &(dyn Fn() + Sync) = &run;
        // SAFETY: `set_openmp_parallel`'s contract makes `addr` a live GOMP_parallel.
        unsafe {
            let parallel: GompParallel = std::mem::transmute(addr);
            parallel(
                trampoline,
                &run as *const &(dyn Fn() + Sync) as *mut c_void,
                threads as c_uint,
                0,
            );
        }
    }
    let end = contention::now_ns();
    let done = caller_done.load(Ordering::Relaxed).clamp(start, end);
    contention::record(end - start, end - done);
    if let Some(payload) = panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
        resume_unwind(payload);
    }
}
