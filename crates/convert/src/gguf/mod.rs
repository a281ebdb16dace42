//! GGUF files written and imported: `smoe export-gguf` ([`export`]) and `smoe shatter FILE.gguf`
//! ([`import`]). Parsing and mapping GGUF files is `smoe_formats::gguf`'s.

pub mod export;
pub mod import;
mod writer;

pub use writer::{TensorDecl, Writer};
