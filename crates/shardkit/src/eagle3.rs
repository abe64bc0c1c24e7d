//! The EAGLE-3 offline target-output cache of NVIDIA NeMo Automodel
//! (`nemo_automodel/components/datasets/llm/eagle3_cache.py`): the frozen target model's
//! per-token supervision, stored once so draft training reads it back.
//!
//! ```text
//! <cache_dir>/manifest.json                  run configuration (format_version 1 or 2)
//!            /shard-NNNNNN.safetensors       samples [k·s, k·s + n), every tensor stacked on dim 0:
//!                input_ids, attention_mask, loss_mask  I64  [n, S]
//!                aux_hidden_states                      bf16|f16|f32 [n, S, 3H]
//!                position_mask                          BOOL [n, S, 1]
//!                target_probs                           bf16|f16|f32 [n, S, Vd]   (lossless)
//!                or target_probs_values / _indices      [n, S, k] / I32 [n, S, k]  (v2 top-k)
//!            /target_embeddings.safetensors  `weight`, F32 [V, H]
//! ```
//!
//! Sample i is row `i % s` of shard `i // s`; the shard set is exactly `0..ceil(N/s)`. Exact
//! behaviour and NeMo's quirks: `shared/formats/eagle3.md`. Every safetensors byte goes through
//! the `safetensors` crate, so shards are byte-identical to Python `save_file` of the same
//! arrays, and malformed files are typed errors ([`crate::Error::Safetensors`]).
//!
//! The types are the offline-cache family's ([`crate::offline`]), shared with `shardkit::dspark`;
//! an EAGLE-3 manifest (it has `aux_hidden_dim`) makes them EAGLE-3's.
//!
//! * [`Writer`]: samples into shards, each file written atomically and durably, the manifest
//!   first; resume continues a killed run byte-identically.
//! * [`PartWriter`]: one cache written by many processes (ranks of `torchrun`, a Slurm
//!   array...), each its block of shards, committed once, byte-identical to one [`Writer`];
//!   [`status`], [`commit_parts`].
//! * [`Cache`]: lazily mapped shards, items without copies, top-k rows expanded.
//! * [`Loader`]: shuffled or sequential batches per epoch, split across ranks like PyTorch's
//!   `DistributedSampler`, read with many reads in flight.
//! * [`validate`], [`inspect`], [`set_version`].
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//!
//! use shardkit::eagle3::{synthetic_sample, Cache, Loader, LoaderOptions, Writer, WriterOptions};
//!
//! # fn main() -> shardkit::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let config = shardkit::json::parse(
//!     br#"{"target_model": "demo", "target_vocab_size": 8, "draft_vocab_size": 8,
//!         "seq_length": 4, "dtype": "fp32", "num_samples": 6, "shard_size": 4,
//!         "aux_hidden_dim": 6, "aux_layer_ids": [1, 2, 3],
//!         "selected_token_ids": [0, 1, 2, 3, 4, 5, 6, 7],
//!         "input_data": "demo", "split": null, "shuffle_seed": 1}"#,
//! )
//! .expect("valid JSON");
//! let mut writer = Writer::create(dir.path(), &config, WriterOptions::default())?;
//! for i in 0..6 {
//!     // Each field's little-endian bytes (synthetic values here).
//!     let fields = synthetic_sample(writer.manifest(), i);
//!     let refs: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (*n, b.as_slice())).collect();
//!     writer.add(1, &refs)?;
//! }
//! writer.finish()?;
//!
//! // Random access, and shuffled batches of 2 samples.
//! let cache = Arc::new(Cache::open(dir.path())?);
//! let item = cache.item(5)?;
//! assert_eq!(cache.fields(&item)?[0].name, "input_ids");
//! let mut opts = LoaderOptions::new(2);
//! opts.seed = 1; // shuffled by default (a new order every epoch)
//! let loader = Loader::new(cache, opts)?;
//! assert_eq!(loader.iter().count(), 3);
//! # Ok(())
//! # }
//! ```

pub use crate::offline::*;
