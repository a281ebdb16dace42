//! The CPU backend against the per-op conformance suite, in both precisions, on one thread and
//! on several (the fast path splits rows and heads into pool tasks).

use smoe_engine::conformance::{check_backend, Tolerance};
use smoe_engine::{CpuBackend, Precision};

#[test]
fn cpu_backend_passes_the_conformance_suite() {
    for (precision, tol) in [(Precision::Reference, Tolerance::F32), (Precision::Fast, Tolerance::INT8_ACTIVATIONS)] {
        for threads in [1, 3] {
            let b = CpuBackend::with_threads(precision, threads);
            match check_backend(&b, &tol) {
                Ok(cases) => assert!(cases > 100, "{precision:?}: only {cases} cases ran"),
                Err(failures) => panic!("{precision:?} on {threads} threads:\n{}", failures.join("\n")),
            }
        }
    }
}

/// The suite sees what it should: the fast path's int8 activations are outside f32's
/// tolerance in the products, and nowhere else.
#[test]
fn the_suite_catches_int8_rounding_held_to_f32() {
    let b = CpuBackend::with_threads(Precision::Fast, 2);
    let failures = check_backend(&b, &Tolerance::F32).expect_err("int8 products are not f32 products");
    assert!(failures.iter().all(|f| f.starts_with("matmul")), "{}", failures.join("\n"));
    assert!(failures.iter().any(|f| f.starts_with("matmul_many")), "{}", failures.join("\n"));
}
