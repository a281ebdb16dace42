//! `smoe shatter` and `smoe export-gguf` killed with SIGKILL at random points, and run out of
//! disk: the output never appears under its final name half-written. It is either absent or
//! byte for byte what an uninterrupted run writes; a killed run leaves at most its temporary
//! file (`OUT.tmp-PID`), which the next run removes; a full disk is a clear error that leaves
//! nothing behind. Counts are printed (docs/reliability.md quotes them).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn smoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smoe")).args(args).output().unwrap()
}

fn ok(o: &Output) {
    assert!(o.status.success(), "exit {:?}\nstderr: {}", o.status, String::from_utf8_lossy(&o.stderr));
}

/// The fixture the commands convert: the largest one (10 MB of checkpoint).
fn fixture() -> String {
    root().join("testdata/hf/qwen3_moe_k").display().to_string()
}

/// xorshift64*, seeded from the clock unless `SMOE_FAULT_SEED` is set (the seed is printed).
struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        let seed = std::env::var("SMOE_FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1);
        eprintln!("SMOE_FAULT_SEED={seed}");
        Rng(seed)
    }
    /// Uniform in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// Names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// What a killed run left.
#[derive(Default, Debug)]
struct Outcomes {
    /// Nothing at all (killed before it created its temporary file).
    nothing: usize,
    /// Only its temporary file (killed while writing).
    temp: usize,
    /// The complete output (killed after the rename, or it finished first).
    complete: usize,
}

/// Runs `args` (whose output is `out`) `runs` times, killing it with SIGKILL at a random point:
/// half the time a random delay after the start (anywhere in the run, start-up included), half
/// the time a random delay after its temporary file appears (inside the write). After each
/// kill the destination is absent or equal to `want`, and nothing but the killed process's
/// temporary file is left beside it. A full run after each kill then removes that file.
fn kill_at_random_points(args: &[&str], out: &Path, want: &[u8], runs: usize, rng: &mut Rng) -> Outcomes {
    let dir = out.parent().unwrap();
    let name = out.file_name().unwrap().to_string_lossy().into_owned();
    let before: Vec<String> = listing(dir).into_iter().filter(|n| *n != name).collect();
    // How long a whole run takes here, to spread the kills over it.
    let t0 = Instant::now();
    ok(&smoe(args));
    let whole = t0.elapsed();
    let mut seen = Outcomes::default();
    for i in 0..runs {
        let _ = std::fs::remove_file(out);
        let mut child = Command::new(env!("CARGO_BIN_EXE_smoe")).args(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let pid = child.id();
        let temp = format!("{name}.tmp-{pid}");
        if i % 2 == 0 {
            std::thread::sleep(Duration::from_micros(rng.below(whole.as_micros() as u64 * 11 / 10)));
        } else {
            // Wait for the temporary file, then kill somewhere inside the write.
            let t = Instant::now();
            while !dir.join(&temp).exists() && t.elapsed() < whole * 4 && child.try_wait().unwrap().is_none() {
                std::thread::sleep(Duration::from_micros(200));
            }
            std::thread::sleep(Duration::from_micros(rng.below(whole.as_micros() as u64 / 2)));
        }
        let _ = child.kill();
        child.wait().unwrap();
        let left: Vec<String> = listing(dir).into_iter().filter(|n| !before.contains(n)).collect();
        let has_out = left.contains(&name);
        let has_temp = left.contains(&temp);
        assert!(
            left.iter().all(|n| *n == name || *n == temp),
            "run {i} (pid {pid}) left files beyond the output and its temporary file: {left:?}"
        );
        if has_out {
            let got = std::fs::read(out).unwrap();
            assert!(got == want, "run {i}: {name} exists but differs from an uninterrupted run ({} of {} bytes)", got.len(), want.len());
        }
        match (has_out, has_temp) {
            (false, false) => seen.nothing += 1,
            (false, true) => seen.temp += 1,
            (true, false) => seen.complete += 1,
            (true, true) => panic!("run {i}: both the output and a temporary file after the rename"),
        }
        if has_temp {
            // The next run removes what the killed one left, and writes the same file.
            ok(&smoe(args));
            assert_eq!(listing(dir).into_iter().filter(|n| !before.contains(n)).collect::<Vec<_>>(), vec![name.clone()], "run {i}");
            assert!(std::fs::read(out).unwrap() == want, "run {i}: the run after a kill differs");
        }
    }
    seen
}

/// `smoe shatter` and `smoe export-gguf`, each killed at 40 random points.
#[test]
fn kill_9_never_leaves_a_half_written_output() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new();
    let fixture = fixture();
    // An uninterrupted run of each, twice: the output is deterministic, so "complete" can
    // mean "byte for byte equal".
    let vault = dir.path().join("m.smoe");
    let vault_s = vault.to_str().unwrap();
    let shatter: Vec<&str> = vec!["shatter", &fixture, "-o", vault_s, "--experts", "BF16", "--dense", "BF16", "--threads", "2"];
    ok(&smoe(&shatter));
    let want_vault = std::fs::read(&vault).unwrap();
    ok(&smoe(&shatter));
    assert!(std::fs::read(&vault).unwrap() == want_vault, "shatter is not deterministic");
    ok(&smoe(&["verify", vault_s]));
    let gguf = dir.path().join("m.gguf");
    let export: Vec<&str> = vec!["export-gguf", vault_s, "-o", gguf.to_str().unwrap()];
    ok(&smoe(&export));
    let want_gguf = std::fs::read(&gguf).unwrap();
    // The vault is moved aside while its shatter is killed, so the export's input stays whole.
    let work = dir.path().join("shatter");
    std::fs::create_dir(&work).unwrap();
    let target = work.join("m.smoe");
    let target_s = target.to_str().unwrap();
    let shatter: Vec<&str> = vec!["shatter", &fixture, "-o", target_s, "--experts", "BF16", "--dense", "BF16", "--threads", "2"];
    let s = kill_at_random_points(&shatter, &target, &want_vault, 40, &mut rng);
    eprintln!("shatter: 40 kills: {s:?}");
    let g = kill_at_random_points(&export, &gguf, &want_gguf, 40, &mut rng);
    eprintln!("export-gguf: 40 kills: {g:?}");
    // Each kind of outcome happened at least once over the 80 kills, or the test did not test.
    assert!(s.temp + g.temp > 0, "no kill landed inside a write: {s:?} {g:?}");
    assert!(s.complete + g.complete + s.nothing + g.nothing > 0, "{s:?} {g:?}");
    // What was complete stays complete: the vault still verifies.
    if target.exists() {
        ok(&smoe(&["verify", target_s]));
    }
}

/// Runs `args` in `sh` with the size of any file it writes limited to `kib` KiB and SIGXFSZ
/// ignored, so a write past the limit fails with EFBIG as a full disk fails with ENOSPC.
fn with_file_size_limit(args: &[&str], kib: u64) -> Output {
    // ulimit -f counts 512-byte blocks in sh (POSIX).
    Command::new("sh")
        .arg("-c")
        .arg(format!("trap '' XFSZ; ulimit -f {}; exec \"$0\" \"$@\"", kib * 2))
        .arg(env!("CARGO_BIN_EXE_smoe"))
        .args(args)
        .output()
        .unwrap()
}

/// A run that cannot write its whole output fails naming the cause and leaves no file behind.
fn assert_failed_clean(o: &Output, dir: &Path, cause: &str, what: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{what}: succeeded on a full disk");
    assert!(err.contains(cause), "{what}: the error does not say {cause:?}: {err}");
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert!(listing(dir).is_empty(), "{what}: left {:?}", listing(dir));
}

/// A tmpfs of `size` mounted on a new directory, unmounted on drop; `None` (with the reason
/// printed) where mounting is not allowed.
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let o = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(dir.path()).output();
        match o {
            Ok(o) if o.status.success() => Some(Tmpfs(dir)),
            Ok(o) => {
                eprintln!("skipped: cannot mount a tmpfs (needs root): {}", String::from_utf8_lossy(&o.stderr).trim());
                None
            }
            Err(e) => {
                eprintln!("skipped: no mount command: {e}");
                None
            }
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}

/// Disk full, two ways: every file limited to 1 MiB (RLIMIT_FSIZE, any user), and a real
/// 1 MiB tmpfs (root only; skipped otherwise). Both commands fail with the cause in the
/// message and leave neither the output nor a temporary file.
#[test]
fn a_full_disk_is_an_error_and_leaves_nothing() {
    let src = tempfile::tempdir().unwrap();
    let fixture = fixture();
    let vault = src.path().join("m.smoe");
    let vault_s = vault.to_str().unwrap().to_string();
    ok(&smoe(&["shatter", &fixture, "-o", &vault_s, "--experts", "BF16", "--dense", "BF16"]));
    assert!(std::fs::metadata(&vault).unwrap().len() > 4 << 20);
    let mut cases = 0;
    // RLIMIT_FSIZE.
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("x.smoe").display().to_string();
    let o = with_file_size_limit(&["shatter", &fixture, "-o", &target, "--experts", "BF16", "--dense", "BF16"], 1024);
    assert_failed_clean(&o, out.path(), "File too large", "shatter under RLIMIT_FSIZE");
    let target = out.path().join("x.gguf").display().to_string();
    let o = with_file_size_limit(&["export-gguf", &vault_s, "-o", &target], 1024);
    assert_failed_clean(&o, out.path(), "File too large", "export-gguf under RLIMIT_FSIZE");
    cases += 2;
    // A full filesystem.
    if let Some(fs) = Tmpfs::mount("1m") {
        let d = fs.0.path();
        let target = d.join("x.smoe").display().to_string();
        let o = smoe(&["shatter", &fixture, "-o", &target, "--experts", "BF16", "--dense", "BF16"]);
        assert_failed_clean(&o, d, "No space left on device", "shatter onto a full tmpfs");
        let target = d.join("x.gguf").display().to_string();
        let o = smoe(&["export-gguf", &vault_s, "-o", &target]);
        assert_failed_clean(&o, d, "No space left on device", "export-gguf onto a full tmpfs");
        cases += 2;
    }
    eprintln!("{cases} full-disk runs failed cleanly");
}
