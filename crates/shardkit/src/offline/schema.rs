//! The members of NeMo Automodel's offline-cache family and what sets them apart.
//!
//! Both caches are a `manifest.json` (Python `json.dump(indent=2, sort_keys=True)` of the run
//! configuration plus `format_version`) and `shard-NNNNNN.safetensors` files of `shard_size`
//! samples each; they differ in the tensors a sample holds, the side file of target weights,
//! the versions NeMo accepts, and DSpark's `complete` marker. A manifest names its member by
//! the key that sizes its hidden states: `aux_hidden_dim` (EAGLE-3) or `target_hidden_dim`
//! (DSpark).

use crate::json::Value;

/// A member of the family: which cache a manifest describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Schema {
    /// The EAGLE-3 target-output cache (`eagle3_cache.py`, format_version 1 or 2).
    Eagle3,
    /// The DSpark target-supervision cache (`dspark_cache.py`, format_version 1).
    DSpark,
}

impl Schema {
    /// Every member.
    pub const ALL: [Schema; 2] = [Schema::Eagle3, Schema::DSpark];

    /// The short name: `"eagle3"` or `"dspark"` (CLI subcommands, loader states, reports).
    pub fn name(self) -> &'static str {
        match self {
            Schema::Eagle3 => "eagle3",
            Schema::DSpark => "dspark",
        }
    }

    /// The name in messages: `"EAGLE-3"` or `"DSpark"`.
    pub fn title(self) -> &'static str {
        match self {
            Schema::Eagle3 => "EAGLE-3",
            Schema::DSpark => "DSpark",
        }
    }

    /// The name with its article, for messages: "an EAGLE-3", "a DSpark".
    pub(crate) fn a(self) -> &'static str {
        match self {
            Schema::Eagle3 => "an EAGLE-3",
            Schema::DSpark => "a DSpark",
        }
    }

    /// The member named `name` (`"eagle3"` or `"dspark"`).
    pub fn from_name(name: &str) -> Option<Schema> {
        Schema::ALL.into_iter().find(|s| s.name() == name)
    }

    /// The fields of an item and of a batch, in the order NeMo's collate stacks them (a top-k
    /// EAGLE-3 cache's `target_probs` is served full width).
    pub fn item_fields(self) -> &'static [&'static str] {
        match self {
            Schema::Eagle3 => &[
                "input_ids",
                "attention_mask",
                "loss_mask",
                "aux_hidden_states",
                "position_mask",
                "target_probs",
            ],
            // `CACHE_KEYS`.
            Schema::DSpark => &[
                "input_ids",
                "loss_mask",
                "target_hidden_states",
                "target_last_hidden_states",
            ],
        }
    }

    /// The `format_version`s NeMo's reader of this member has accepted.
    pub(crate) fn versions(self) -> &'static [u8] {
        match self {
            Schema::Eagle3 => &[1, 2],
            Schema::DSpark => &[1],
        }
    }

    /// The versions, for messages: "1 or 2", "1".
    pub(crate) fn versions_text(self) -> String {
        let v: Vec<String> = self.versions().iter().map(u8::to_string).collect();
        v.join(" or ")
    }

    /// The key only this member's manifest has, which sizes its hidden states.
    pub(crate) fn marker_key(self) -> &'static str {
        match self {
            Schema::Eagle3 => "aux_hidden_dim",
            Schema::DSpark => "target_hidden_dim",
        }
    }

    /// The member a manifest object describes, from its marker key; `None` when it has neither
    /// or both.
    pub(crate) fn of_manifest(obj: &Value) -> Option<Schema> {
        let mut found = Schema::ALL
            .into_iter()
            .filter(|s| obj.get(s.marker_key()).is_some());
        match (found.next(), found.next()) {
            (Some(s), None) => Some(s),
            _ => None,
        }
    }

    /// The keys NeMo's producer writes, all required when shardkit writes a manifest.
    pub(crate) fn producer_keys(self) -> &'static [&'static str] {
        match self {
            Schema::Eagle3 => &[
                "target_model",
                "target_vocab_size",
                "draft_vocab_size",
                "seq_length",
                "dtype",
                "num_samples",
                "shard_size",
                "aux_hidden_dim",
                "aux_layer_ids",
                "selected_token_ids",
            ],
            // `build_cache_manifest`, the one source of DSpark's manifest schema.
            Schema::DSpark => &[
                "target_model",
                "target_model_type",
                "target_vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "seq_length",
                "dtype",
                "num_samples",
                "shard_size",
                "target_hidden_dim",
                "target_last_hidden_dim",
                "target_layer_ids",
                "train_data_path",
                "train_split",
                "shuffle_seed",
                "mask_reasoning_content",
                "chat_template_sha256",
            ],
        }
    }

    /// The file of target weights beside the shards.
    pub fn weights_file(self) -> &'static str {
        match self {
            Schema::Eagle3 => "target_embeddings.safetensors",
            Schema::DSpark => "target_weights.safetensors",
        }
    }

    /// The tensors of the weights file, in name order.
    pub fn weight_tensors(self) -> &'static [&'static str] {
        match self {
            Schema::Eagle3 => &["weight"],
            Schema::DSpark => &["embed_tokens.weight", "lm_head.weight"],
        }
    }

    /// Whether the manifest carries the `complete` marker (written `false` before the first
    /// shard, `true` once every shard is down; absent in caches older than the marker).
    pub(crate) fn has_complete_marker(self) -> bool {
        self == Schema::DSpark
    }
}

impl std::fmt::Display for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.title())
    }
}
