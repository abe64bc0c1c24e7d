//! The DSpark offline target-supervision cache of NVIDIA NeMo Automodel
//! (`nemo_automodel/components/datasets/llm/dspark_cache.py`, format_version 1): the frozen
//! target's intermediate and final hidden states, stored once so DSpark draft training runs
//! without the target model.
//!
//! ```text
//! <cache_dir>/manifest.json               run configuration, input identity, `complete`
//!            /shard-NNNNNN.safetensors    samples [k·s, k·s + n), every tensor stacked on dim 0:
//!                input_ids, loss_mask          I64 [n, S]
//!                target_hidden_states          bf16|f16|f32 [n, S, target_hidden_dim]
//!                target_last_hidden_states     bf16|f16|f32 [n, S, target_last_hidden_dim]
//!            /target_weights.safetensors  embed_tokens.weight, lm_head.weight  [V, H]
//! ```
//!
//! The manifest records the run's input identity (`train_data_path`, `train_split`,
//! `shuffle_seed`, `mask_reasoning_content`, `chat_template_sha256`): a rerun into a directory
//! whose manifest differs in any key but `format_version` and `complete` is refused, naming the
//! keys, as NeMo's producers refuse it. `complete` is written `false` before the first shard
//! and `true` once every shard is down; readers refuse a cache marked incomplete. Exact
//! behaviour and NeMo's quirks: docs/dspark.md.
//!
//! The types are the offline-cache family's ([`crate::offline`]), shared with
//! `shardkit::eagle3`; a DSpark manifest (it has `target_hidden_dim`) makes them DSpark's:
//! [`Writer`] (crash-safe, resumable), [`PartWriter`] (NeMo's shard partition, so a cache begun
//! by NeMo's distributed producer can be finished by shardkit and the other way round),
//! [`Cache`], [`Loader`], [`validate`], [`inspect`].
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//!
//! use shardkit::dspark::{synthetic_sample, Cache, Loader, LoaderOptions, Writer, WriterOptions};
//!
//! # fn main() -> shardkit::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let config = shardkit::json::parse(
//!     br#"{"target_model": "demo", "target_model_type": "qwen3", "target_vocab_size": 8,
//!         "hidden_size": 2, "num_hidden_layers": 4, "seq_length": 4, "dtype": "bf16",
//!         "num_samples": 6, "shard_size": 4, "target_hidden_dim": 6,
//!         "target_last_hidden_dim": 2, "target_layer_ids": [0, 1, 3],
//!         "train_data_path": "demo.jsonl", "train_split": null, "shuffle_seed": 42,
//!         "mask_reasoning_content": false, "chat_template_sha256": "e3b0c442"}"#,
//! )
//! .expect("valid JSON");
//! let mut writer = Writer::create(dir.path(), &config, WriterOptions::default())?;
//! for i in 0..6 {
//!     let fields = synthetic_sample(writer.manifest(), i);
//!     let refs: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (*n, b.as_slice())).collect();
//!     writer.add(1, &refs)?;
//! }
//! writer.finish()?; // manifest.json now says "complete": true
//!
//! let cache = Arc::new(Cache::open(dir.path())?);
//! let names: Vec<&str> = cache.fields(&cache.item(5)?)?.iter().map(|f| f.name).collect();
//! assert_eq!(names, ["input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"]);
//! let loader = Loader::new(cache, LoaderOptions::new(2))?;
//! assert_eq!(loader.iter().count(), 3);
//! # Ok(())
//! # }
//! ```

pub use crate::offline::*;
