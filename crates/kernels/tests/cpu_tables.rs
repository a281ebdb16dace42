//! Every kernel table this CPU can run is in [`smoe_kernels::available()`].
//!
//! The kernel tests (`src/tests.rs`) check each table that `available()` lists against the
//! scalar reference. Were a table missing on a CPU that supports it (a detection bug, a
//! `cfg` gone wrong), they would pass having tested scalar code only, and CI would stay green
//! without running the SIMD paths the CPU has. This test fails instead.
//!
//! On x86-64 the CPU's features are read from `/proc/cpuinfo` where it exists: the operating
//! system's view, independent of the detection code under test (it also agrees with std's
//! `is_x86_feature_detected!`, or the test says where they differ). Elsewhere std's detection
//! is the reference.

fn isas() -> Vec<&'static str> {
    smoe_kernels::available().iter().map(|k| k.isa).collect()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    /// Each table after the scalar one, best first, with the features its kernels use: as
    /// `is_x86_feature_detected!` names them and as `/proc/cpuinfo` does.
    const TABLES: [(&str, &[(&str, &str)]); 3] = [
        (
            "avx512-amx",
            &[
                ("avx2", "avx2"),
                ("fma", "fma"),
                ("f16c", "f16c"),
                ("avx512f", "avx512f"),
                ("avx512bw", "avx512bw"),
                ("avx512vl", "avx512vl"),
                ("avx512vnni", "avx512_vnni"),
                ("avx512dq", "avx512dq"),
                ("amx-tile", "amx_tile"),
                ("amx-int8", "amx_int8"),
            ],
        ),
        (
            "avx512-vnni",
            &[
                ("avx2", "avx2"),
                ("fma", "fma"),
                ("f16c", "f16c"),
                ("avx512f", "avx512f"),
                ("avx512bw", "avx512bw"),
                ("avx512vl", "avx512vl"),
                ("avx512vnni", "avx512_vnni"),
            ],
        ),
        ("avx2", &[("avx2", "avx2"), ("fma", "fma"), ("f16c", "f16c")]),
    ];

    /// std's run-time detection (the macro wants a literal).
    fn std_detects(feature: &str) -> bool {
        match feature {
            "avx2" => is_x86_feature_detected!("avx2"),
            "fma" => is_x86_feature_detected!("fma"),
            "f16c" => is_x86_feature_detected!("f16c"),
            "avx512f" => is_x86_feature_detected!("avx512f"),
            "avx512bw" => is_x86_feature_detected!("avx512bw"),
            "avx512vl" => is_x86_feature_detected!("avx512vl"),
            "avx512vnni" => is_x86_feature_detected!("avx512vnni"),
            "avx512dq" => is_x86_feature_detected!("avx512dq"),
            // std's detection of AMX is not stable yet: CPUID leaf 7's EDX bits 24 and 25.
            "amx-tile" => (std::arch::x86_64::__cpuid_count(7, 0).edx >> 24) & 1 == 1,
            "amx-int8" => (std::arch::x86_64::__cpuid_count(7, 0).edx >> 25) & 1 == 1,
            _ => panic!("no detection for {feature}: add it to std_detects"),
        }
    }

    /// The first CPU's flags from `/proc/cpuinfo`; `None` where there is no such file.
    fn cpuinfo_flags() -> Option<Vec<String>> {
        let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        let line = text.lines().find(|l| l.split(':').next().is_some_and(|k| k.trim() == "flags"))?;
        Some(line.split_once(':')?.1.split_whitespace().map(str::to_owned).collect())
    }

    #[test]
    fn every_table_the_cpu_supports_is_available() {
        let flags = cpuinfo_flags();
        let source = if flags.is_some() { "/proc/cpuinfo" } else { "is_x86_feature_detected!" };
        let mut want = Vec::new();
        for (isa, features) in TABLES {
            let mut has_all = true;
            for &(std_name, cpuinfo_name) in features {
                let by_std = std_detects(std_name);
                let has = match &flags {
                    Some(flags) => {
                        let by_os = flags.iter().any(|f| f == cpuinfo_name);
                        assert_eq!(
                            by_os,
                            by_std,
                            "/proc/cpuinfo {} `{cpuinfo_name}` but is_x86_feature_detected!(\"{std_name}\") is {by_std}: \
                             the kernel tables follow std's detection, so they disagree with the OS about this CPU",
                            if by_os { "lists" } else { "does not list" },
                        );
                        by_os
                    }
                    None => by_std,
                };
                has_all &= has;
            }
            if has_all {
                want.push(isa);
            }
        }
        want.push("scalar");
        let have = super::isas();
        for isa in &want {
            assert!(
                have.contains(isa),
                "this CPU supports the `{isa}` kernel table (features per {source}) but smoe_kernels::available() \
                 lists only {have:?}: its SIMD kernels would go untested"
            );
        }
        assert_eq!(have, want, "smoe_kernels::available() should list exactly the tables this CPU supports, best first");
    }
}

/// NEON is part of the aarch64 baseline: its table is always there.
#[cfg(target_arch = "aarch64")]
#[test]
fn the_neon_table_is_available() {
    assert!(std::arch::is_aarch64_feature_detected!("neon"), "an aarch64 CPU without NEON");
    assert_eq!(isas(), ["neon", "scalar"], "smoe_kernels::available() should list the NEON table, then the scalar one");
}

/// No SIMD tables on other architectures: just the scalar one.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
#[test]
fn only_the_scalar_table() {
    assert_eq!(isas(), ["scalar"]);
}
