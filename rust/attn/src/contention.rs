//! Shared cores: when a team keeps waiting for its own threads, work alone for a while.
//!
//! A parallel region ends when every thread of the team has finished. On a machine where
//! another job takes a core (a build beside the server, even at `nice 19` when it runs in
//! another session: the kernel then shares the cores between sessions, not by niceness),
//! one of our two threads is off the CPU for milliseconds at a time, and the other waits for
//! it at the end of every region, hundreds of times a decode step: measured on 2 cores with
//! a 2-job busy session beside it, SmolLM2's decode step went from 5 to 20 ms, where one
//! thread alone takes 10. So the calling thread times, for each region, how long it waited
//! after its own share (`record`); when that waiting is over a quarter of the regions' time
//! in two 50 ms windows in a row, every region runs on the calling thread alone (`allowed`)
//! for the next half second, then the team is tried again. A quiet machine waits a few
//! percent (one window can be worse, e.g. while workers wake from sleep), and does not switch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

const WINDOW_NS: u64 = 50_000_000;
const SOLO_NS: u64 = 500_000_000;

/// The rule, over explicit times (nanoseconds on one monotonic clock); one per process.
pub struct Detector {
    solo_until: AtomicU64,
    window_start: AtomicU64,
    window_wait: AtomicU64,
    window_total: AtomicU64,
    bad_windows: AtomicU64,
    solo_spells: AtomicU64,
}

impl Detector {
    pub const fn new() -> Self {
        Detector {
            solo_until: AtomicU64::new(0),
            window_start: AtomicU64::new(0),
            window_wait: AtomicU64::new(0),
            window_total: AtomicU64::new(0),
            bad_windows: AtomicU64::new(0),
            solo_spells: AtomicU64::new(0),
        }
    }

    /// The threads a region starting at `now` may use: `threads`, or 1 while solo.
    pub fn allowed(&self, now: u64, threads: usize) -> usize {
        if threads > 1 && now < self.solo_until.load(Ordering::Relaxed) {
            1
        } else {
            threads
        }
    }

    /// A region ending at `now` took `total` ns, of which the caller waited `wait` for the
    /// others. (Relaxed counters: a region recorded into the wrong window changes nothing.)
    pub fn record(&self, now: u64, total: u64, wait: u64) {
        let start = self.window_start.load(Ordering::Relaxed);
        if now.saturating_sub(start) > WINDOW_NS {
            self.window_start.store(now, Ordering::Relaxed);
            let wait = self.window_wait.swap(0, Ordering::Relaxed);
            let total = self.window_total.swap(0, Ordering::Relaxed);
            // decide only on a window the regions filled for a fifth or more
            if total * 5 >= WINDOW_NS && wait * 4 > total {
                if self.bad_windows.fetch_add(1, Ordering::Relaxed) >= 1 {
                    self.bad_windows.store(0, Ordering::Relaxed);
                    self.solo_until.store(now + SOLO_NS, Ordering::Relaxed);
                    self.solo_spells.fetch_add(1, Ordering::Relaxed);
                }
            } else {
                self.bad_windows.store(0, Ordering::Relaxed);
            }
        }
        self.window_wait.fetch_add(wait, Ordering::Relaxed);
        self.window_total.fetch_add(total, Ordering::Relaxed);
    }

    /// How many times the team was sent home (for logs and metrics).
    pub fn solo_spells(&self) -> u64 {
        self.solo_spells.load(Ordering::Relaxed)
    }
}

impl Default for Detector {
    fn default() -> Self {
        Self::new()
    }
}

static EPOCH: OnceLock<Instant> = OnceLock::new();
static DETECTOR: Detector = Detector::new();

/// Nanoseconds since the first call (a monotonic clock).
pub(crate) fn now_ns() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

pub(crate) fn allowed(threads: usize) -> usize {
    DETECTOR.allowed(now_ns(), threads)
}

pub(crate) fn record(total_ns: u64, wait_ns: u64) {
    DETECTOR.record(now_ns(), total_ns, wait_ns)
}

/// How many times this process's team went solo.
pub fn solo_spells() -> u64 {
    DETECTOR.solo_spells()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Regions of `region` ns back to back from `from` for `span` ns, each waiting `wait`.
    fn busy(d: &Detector, from: u64, span: u64, region: u64, wait: u64) -> u64 {
        let mut t = from;
        while t < from + span {
            t += region;
            d.record(t, region, wait);
        }
        t
    }

    #[test]
    fn a_quiet_team_stays_a_team() {
        let d = Detector::new();
        let t = busy(&d, 0, 2000 * MS, 20_000, 1_000); // 5% waiting
        assert_eq!(d.allowed(t, 2), 2);
        assert_eq!(d.solo_spells(), 0);
    }

    #[test]
    fn one_bad_window_is_not_enough_two_are() {
        let d = Detector::new();
        let t = busy(&d, 0, 200 * MS, 20_000, 1_000);
        let t = busy(&d, t, 60 * MS, 20_000, 15_000); // one window at 75% waiting
        let t = busy(&d, t, 120 * MS, 20_000, 1_000);
        assert_eq!((d.allowed(t, 2), d.solo_spells()), (2, 0));
        let t = busy(&d, t, 160 * MS, 20_000, 15_000); // waiting on and on
        assert_eq!((d.allowed(t, 2), d.solo_spells()), (1, 1));
        assert_eq!(d.allowed(t, 1), 1);
        assert_eq!(d.allowed(t + SOLO_NS, 2), 2, "the team is tried again");
    }

    #[test]
    fn sparse_regions_decide_nothing() {
        // a region now and then (an idle server): the waits of waking workers do not count
        let d = Detector::new();
        let mut t = 0;
        for _ in 0..100 {
            t += 30 * MS;
            d.record(t, 100_000, 90_000);
        }
        assert_eq!((d.allowed(t, 2), d.solo_spells()), (2, 0));
    }
}
