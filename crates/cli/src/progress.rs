//! Conversion progress: a bar with bytes, rate and ETA on a terminal, plain log lines otherwise.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Progress reporting for `shatter` and friends.
pub struct CliProgress {
    bar: Option<ProgressBar>,
    total: AtomicU64,
    done: AtomicU64,
    last_logged: Mutex<(Instant, u64)>,
    started: Instant,
}

impl CliProgress {
    pub fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new(0);
            b.set_style(
                ProgressStyle::with_template("{spinner} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
                    .unwrap()
                    .progress_chars("=> "),
            );
            b
        });
        CliProgress {
            bar,
            total: AtomicU64::new(0),
            done: AtomicU64::new(0),
            last_logged: Mutex::new((Instant::now(), 0)),
            started: Instant::now(),
        }
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl smoe_convert::Progress for CliProgress {
    fn start(&self, total: u64) {
        // A job may run in phases (synth into GGUF: the dense vault, then the file), each
        // starting afresh.
        self.total.store(total, Ordering::Relaxed);
        self.done.store(0, Ordering::Relaxed);
        *self.last_logged.lock().unwrap() = (Instant::now(), 0);
        match &self.bar {
            Some(b) => {
                b.set_length(total);
                b.set_position(0);
            }
            None => eprintln!("converting {:.2} GiB of checkpoint data", gib(total)),
        }
    }
    fn advance(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if let Some(b) = &self.bar {
            b.inc(bytes);
            return;
        }
        let total = self.total.load(Ordering::Relaxed).max(1);
        let mut last = self.last_logged.lock().unwrap();
        // A line every 10% or 30 s, whichever comes first.
        if done - last.1 >= total / 10 || last.0.elapsed().as_secs() >= 30 {
            let secs = self.started.elapsed().as_secs_f64().max(1e-3);
            let rate = done as f64 / secs;
            let eta = (total.saturating_sub(done)) as f64 / rate.max(1.0);
            eprintln!(
                "  {:5.1}%  {:.2}/{:.2} GiB  {:.0} MiB/s  ETA {:.0} s",
                100.0 * done as f64 / total as f64,
                gib(done),
                gib(total),
                rate / (1 << 20) as f64,
                eta
            );
            *last = (Instant::now(), done);
        }
    }
    fn note(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.println(format!("note: {msg}")),
            None => eprintln!("note: {msg}"),
        }
    }
    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
