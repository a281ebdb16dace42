//! The fixed header at the start of every vault (one aligned page).

use crate::VaultError;

/// File magic: the first eight bytes of every vault.
pub const MAGIC: [u8; 8] = *b"SMOEVLT\0";
/// Major format version this crate reads and writes. A different major is refused.
pub const FORMAT_MAJOR: u16 = 1;
/// Minor format version this crate writes. Newer minors are read (they only add optional
/// manifest fields); see docs/vault-format.md.
pub const FORMAT_MINOR: u16 = 0;
/// Alignment of the regions and of every expert blob.
pub const DEFAULT_ALIGNMENT: u32 = 4096;
/// Bytes of the header that carry fields; the rest of the first page is zero.
pub const HEADER_LEN: usize = 128;

/// Decoded header fields. Offsets are absolute file offsets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Major format version.
    pub major: u16,
    /// Minor format version.
    pub minor: u16,
    /// Alignment of regions and blobs (a power of two, at least 512).
    pub alignment: u32,
    /// Total file length.
    pub file_len: u64,
    /// Manifest (UTF-8 JSON) offset.
    pub manifest_offset: u64,
    /// Manifest length.
    pub manifest_len: u64,
    /// xxh3-64 of the manifest bytes.
    pub manifest_checksum: u64,
    /// Dense region offset.
    pub dense_offset: u64,
    /// Dense region length.
    pub dense_len: u64,
    /// Expert region offset.
    pub experts_offset: u64,
    /// Expert region length.
    pub experts_len: u64,
}

impl Header {
    /// Serialises into the first [`HEADER_LEN`] bytes, checksum last.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.major.to_le_bytes());
        b[10..12].copy_from_slice(&self.minor.to_le_bytes());
        b[12..16].copy_from_slice(&self.alignment.to_le_bytes());
        let fields = [
            self.file_len,
            self.manifest_offset,
            self.manifest_len,
            self.manifest_checksum,
            self.dense_offset,
            self.dense_len,
            self.experts_offset,
            self.experts_len,
        ];
        for (i, f) in fields.iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&f.to_le_bytes());
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&b[..HEADER_LEN - 8]);
        b[HEADER_LEN - 8..].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Parses and validates a header: magic, checksum, version, alignment and region bounds.
    pub fn decode(b: &[u8]) -> Result<Header, VaultError> {
        if b.len() < HEADER_LEN {
            return Err(VaultError::Truncated { what: "header".into(), need: HEADER_LEN as u64, have: b.len() as u64 });
        }
        if b[0..8] != MAGIC {
            return Err(VaultError::BadMagic { found: b[0..8].try_into().unwrap() });
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let (major, minor) = (u16_at(8), u16_at(10));
        if major != FORMAT_MAJOR {
            return Err(VaultError::UnsupportedVersion { major, minor });
        }
        let stored = u64_at(HEADER_LEN - 8);
        if xxhash_rust::xxh3::xxh3_64(&b[..HEADER_LEN - 8]) != stored {
            return Err(VaultError::Checksum { what: "header".into() });
        }
        let h = Header {
            major,
            minor,
            alignment: u32::from_le_bytes(b[12..16].try_into().unwrap()),
            file_len: u64_at(16),
            manifest_offset: u64_at(24),
            manifest_len: u64_at(32),
            manifest_checksum: u64_at(40),
            dense_offset: u64_at(48),
            dense_len: u64_at(56),
            experts_offset: u64_at(64),
            experts_len: u64_at(72),
        };
        h.check_layout()?;
        Ok(h)
    }

    fn check_layout(&self) -> Result<(), VaultError> {
        let bad = |m: String| Err(VaultError::Corrupt(m));
        if !self.alignment.is_power_of_two() || self.alignment < 512 {
            return bad(format!("alignment {} is not a power of two >= 512", self.alignment));
        }
        let a = self.alignment as u64;
        let regions = [
            ("dense region", self.dense_offset, self.dense_len),
            ("expert region", self.experts_offset, self.experts_len),
            ("manifest", self.manifest_offset, self.manifest_len),
        ];
        for (name, off, len) in regions {
            if off % a != 0 {
                return bad(format!("{name} offset {off} is not {a}-aligned"));
            }
            match off.checked_add(len) {
                Some(end) if end <= self.file_len => {}
                _ => return bad(format!("{name} ({off}+{len}) runs past the file length {}", self.file_len)),
            }
        }
        if self.dense_offset < a || self.experts_offset < self.dense_offset + self.dense_len {
            return bad("regions overlap".into());
        }
        Ok(())
    }
}
