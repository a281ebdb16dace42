//! Routing traces: which experts a model chose, per text, position and MoE layer, as a
//! safetensors file with one integer tensor `experts` of shape `[texts, positions, layers,
//! top_k]` (the layout of `testdata/traces`). Read for `smoe replay`, which runs them through the
//! expert cache's eviction policies, and by `smoe bench --routing-trace`.

use crate::FormatError;
use std::path::Path;

/// A routing trace.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingTrace {
    /// Texts, positions per text, MoE layers, experts per token.
    pub shape: [usize; 4],
    /// Expert ids in that order.
    pub experts: Vec<u32>,
    /// The token ids the routing was recorded on (`input_ids`, `[texts, positions]`), if the
    /// file has them.
    pub input_ids: Option<Vec<u32>>,
}

impl RoutingTrace {
    /// The largest expert id plus one.
    pub fn num_experts(&self) -> usize {
        self.experts.iter().max().map_or(0, |&m| m as usize + 1)
    }

    /// The experts of (text, position, layer).
    pub fn experts_at(&self, text: usize, pos: usize, layer: usize) -> &[u32] {
        let [_, p, l, k] = self.shape;
        let b = ((text * p + pos) * l + layer) * k;
        &self.experts[b..b + k]
    }
}

/// The trace bundled with smoe: the routing of a small trained MoE over held-out text (see
/// `testdata/README.fixtures.md`), the default for benchmarks that replay routing.
pub const BUNDLED: (&str, &[u8]) = ("trained_moe_48x6", include_bytes!("../../../testdata/traces/trained_moe_48x6.safetensors"));

/// The bundled trace, parsed.
pub fn bundled() -> RoutingTrace {
    parse(BUNDLED.1, BUNDLED.0).expect("the bundled trace is valid")
}

/// Traces are small (a few MB); a file above this is refused rather than read into memory.
const MAX_TRACE_BYTES: u64 = 1 << 30;

/// Reads `path`, at most 1 GiB, and [parses](parse) it.
pub fn read(path: &Path) -> Result<RoutingTrace, FormatError> {
    let len = std::fs::metadata(path).map_err(|e| FormatError::io(path, e))?.len();
    if len > MAX_TRACE_BYTES {
        return Err(FormatError::BadInput(format!("{}: {len} bytes is too large for a routing trace", path.display())));
    }
    let bytes = std::fs::read(path).map_err(|e| FormatError::io(path, e))?;
    parse(&bytes, &path.display().to_string())
}

/// Parses a trace file's bytes (`name` for messages). Sizes are checked against the bytes
/// before anything is allocated from them; negative or non-integer ids are refused with a
/// message.
pub fn parse(bytes: &[u8], name: &str) -> Result<RoutingTrace, FormatError> {
    let bad = |m: String| FormatError::BadInput(format!("{name}: {m}"));
    let file_len = bytes.len() as u64;
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
        .ok_or_else(|| bad("too short for a safetensors header".into()))?;
    if n > 1 << 20 || 8 + n > file_len {
        return Err(bad(format!("header length {n} is impossible")));
    }
    let v: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n as usize]).map_err(|e| bad(format!("header JSON: {e}")))?;
    let (shape, experts) = int_tensor(bytes, &v, n, "experts", &bad)?
        .ok_or_else(|| bad("no tensor `experts` (a routing trace has [texts, positions, layers, top_k] expert ids)".into()))?;
    let &[texts, pos, layers, k] = shape.as_slice() else {
        return Err(bad(format!("`experts` has shape {shape:?}, not [texts, positions, layers, top_k]")));
    };
    if experts.is_empty() {
        return Err(bad("the trace is empty".into()));
    }
    let input_ids = int_tensor(bytes, &v, n, "input_ids", &bad)?.map(|(_, ids)| ids);
    Ok(RoutingTrace { shape: [texts as usize, pos as usize, layers as usize, k as usize], experts, input_ids })
}

/// An integer tensor's shape and values.
type IntTensor = (Vec<u64>, Vec<u32>);

/// The integer tensor `name` of a safetensors file's bytes (header `v`, `n` bytes long), as
/// non-negative values with its shape; `None` if absent. Sizes are checked against the bytes
/// before anything is allocated from them.
fn int_tensor(
    bytes: &[u8],
    v: &serde_json::Map<String, serde_json::Value>,
    n: u64,
    name: &str,
    bad: &dyn Fn(String) -> FormatError,
) -> Result<Option<IntTensor>, FormatError> {
    let Some(t) = v.get(name) else { return Ok(None) };
    let size = match t.get("dtype").and_then(|d| d.as_str()) {
        Some("I16") => 2,
        Some("I32") => 4,
        Some("I64") => 8,
        other => return Err(bad(format!("`{name}` has dtype {other:?}; a trace holds integers (I16, I32 or I64)"))),
    };
    let shape: Vec<u64> =
        t.get("shape").and_then(|s| s.as_array()).map(|a| a.iter().filter_map(|x| x.as_u64()).collect()).unwrap_or_default();
    let off = t.get("data_offsets").and_then(|o| o.as_array()).filter(|o| o.len() == 2);
    let (start, end) = match off.map(|o| (o[0].as_u64(), o[1].as_u64())) {
        Some((Some(s), Some(e))) if s <= e => (s, e),
        _ => return Err(bad(format!("`{name}` has bad data_offsets"))),
    };
    let elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or_else(|| bad("shape overflows".into()))?;
    if elems.checked_mul(size) != Some(end - start) || 8 + n + end > bytes.len() as u64 {
        return Err(bad(format!("`{name}` data does not match shape {shape:?} or lies past the end of the file")));
    }
    let raw = &bytes[(8 + n + start) as usize..(8 + n + end) as usize];
    let values = raw
        .chunks_exact(size as usize)
        .map(|c| {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            // Sign-extend from the stored width.
            let shift = 64 - 8 * c.len() as u32;
            let v = (i64::from_le_bytes(b) << shift) >> shift;
            u32::try_from(v).map_err(|_| bad(format!("`{name}` holds {v}, not an id")))
        })
        .collect::<Result<Vec<u32>, _>>()?;
    Ok(Some((shape, values)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, header: &str, data: &[u8]) -> std::path::PathBuf {
        let p = dir.join("t.safetensors");
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.extend_from_slice(data);
        std::fs::write(&p, b).unwrap();
        p
    }

    #[test]
    fn reads_the_bundled_trace_and_refuses_bad_ones() {
        let t = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/traces/trained_moe_48x6.safetensors")).unwrap();
        assert_eq!((t.shape[2], t.shape[3], t.num_experts()), (6, 6, 48));
        assert_eq!(t.experts_at(0, 0, 0).len(), 6);
        assert_eq!(bundled(), t);
        assert_eq!(t.input_ids.as_ref().map(Vec::len), Some(t.shape[0] * t.shape[1]));
        assert!(parse(&[1, 2], "x").unwrap_err().to_string().contains("too short"));
        let dir = tempfile::tempdir().unwrap();
        let ok = r#"{"experts":{"dtype":"I32","shape":[1,1,1,2],"data_offsets":[0,8]}}"#;
        let good = write(dir.path(), ok, &[3, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(read(&good).unwrap().experts, vec![3, 1]);
        for (header, data, want) in [
            (r#"{"experts":{"dtype":"F32","shape":[1,1,1,2],"data_offsets":[0,8]}}"#, vec![0u8; 8], "dtype"),
            (r#"{"experts":{"dtype":"I32","shape":[1,1,2],"data_offsets":[0,8]}}"#, vec![0u8; 8], "shape"),
            (r#"{"experts":{"dtype":"I32","shape":[1,1,1,2],"data_offsets":[0,8]}}"#, vec![0u8; 4], "past the end"),
            (r#"{"experts":{"dtype":"I64","shape":[4294967296,4294967296,1,1],"data_offsets":[0,8]}}"#, vec![0u8; 8], "overflows"),
            (r#"{"experts":{"dtype":"I16","shape":[1,1,1,1],"data_offsets":[0,2]}}"#, vec![0xFF, 0xFF], "not an id"),
            (r#"{"other":{}}"#, vec![], "no tensor"),
        ] {
            let e = read(&write(dir.path(), header, &data)).unwrap_err().to_string();
            assert!(e.contains(want), "{header}: {e}");
        }
    }
}
