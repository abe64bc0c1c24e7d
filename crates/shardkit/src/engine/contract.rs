//! The loader contract: what every format's loader (saev, flat-tokens, EAGLE-3) takes and
//! gives back the same way.
//!
//! * [`LoaderOptions`]: the knobs every loader has (batch size, order, seed, epoch, rank and
//!   world size, `drop_last`, threads, verification), with their defaults written once in
//!   `LoaderOptions::with_format`, and the format's own knobs beside them in `format` (a
//!   field of each format's options struct reads as a field of the whole: `o.layer`).
//! * [`LoaderState`]: the position a loader's `state()` returns and its `load_state` takes:
//!   seed, epoch, next batch, batch size and world size, then the format's own keys (its exact
//!   position and every parameter that decides which rows land in which batch) in the order a
//!   user's saved state lists them. Bindings convert it to a dict (or JSON) and back key by
//!   key, without knowing the format.
//!
//! Seqax's names (`host_index`, `host_count`, `batch`) are aliases at the edge (Python
//! keywords), not fields here.

use std::ops::{Deref, DerefMut};

use crate::engine::order::Order;
use crate::error::{Error, Result};

/// The order a loader serves when none is asked for: shuffled (saev's block order; EAGLE-3's
/// and flat-tokens' only shuffled order).
pub const DEFAULT_ORDER: Order = Order::Block;

/// Options of every loader: the common knobs, and the format's own in `format` (reachable as
/// fields of the whole through `Deref`). Build one with the format's constructor
/// (`saev::LoaderOptions::new(layer)`, `eagle3::LoaderOptions::new(batch_size)`,
/// `flat_tokens::LoaderOptions::new(seq_len, batch_size)`), then set fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderOptions<F> {
    /// Rows (samples) per batch on each rank; flat-tokens: rows per step over all hosts
    /// (seqax's `batch`, which each host slices).
    pub batch_size: u64,
    /// The order ([`DEFAULT_ORDER`] by default). [`Order::Sequential`] is storage order; EAGLE-3
    /// has one shuffled order (a full permutation per epoch) that both shuffled values select,
    /// and flat-tokens serves seqax's shuffled order only.
    pub order: Order,
    /// Shuffle seed.
    pub seed: u64,
    /// Epoch; each epoch is a different order (flat-tokens counts steps across epochs instead).
    pub epoch: u64,
    /// This rank (default: `$RANK`, else 0; flat-tokens: 0, seqax's hosts are not torch ranks).
    pub rank: Option<u64>,
    /// Number of ranks (default: `$WORLD_SIZE`, else 1; flat-tokens: 1).
    pub world_size: Option<u64>,
    /// Drop the final partial batch (on every rank alike). flat-tokens serves full batches
    /// only (seqax's `step_count`), so its options start with `true`.
    pub drop_last: bool,
    /// Threads that gather rows into batches (0, the default: one per core).
    pub threads: usize,
    /// Check every block the loader reads against the dataset's checksums sidecar
    /// (`shardkit.checksums.json`); a damaged block is an error naming the file and its bytes.
    pub verify: bool,
    /// The format's own knobs.
    pub format: F,
}

impl<F> LoaderOptions<F> {
    /// `batch_size` and `format`, every common knob at its default: [`DEFAULT_ORDER`], seed 0,
    /// epoch 0, rank and world size from the environment, `drop_last` false, one thread per
    /// core, no verification.
    pub(crate) fn with_format(batch_size: u64, format: F) -> LoaderOptions<F> {
        LoaderOptions {
            batch_size,
            order: DEFAULT_ORDER,
            seed: 0,
            epoch: 0,
            rank: None,
            world_size: None,
            drop_last: false,
            threads: 0,
            verify: false,
            format,
        }
    }

    /// Whether the order is shuffled (not [`Order::Sequential`]).
    pub(crate) fn shuffled(&self) -> bool {
        self.order != Order::Sequential
    }

    /// Shuffled or not (the `shuffle` keyword of the Python loaders): `false` is
    /// [`Order::Sequential`]; `true` keeps a shuffled order and turns a sequential one into
    /// [`DEFAULT_ORDER`].
    pub fn set_shuffle(&mut self, shuffle: bool) {
        if !shuffle {
            self.order = Order::Sequential;
        } else if self.order == Order::Sequential {
            self.order = DEFAULT_ORDER;
        }
    }

    /// `(rank, world_size)`: the options', else `$RANK` / `$WORLD_SIZE`, else `(0, 1)`.
    pub(crate) fn rank_and_world(&self) -> Result<(u64, u64)> {
        crate::engine::dist::rank_and_world(self.rank, self.world_size)
    }
}

impl<F> Deref for LoaderOptions<F> {
    type Target = F;
    fn deref(&self) -> &F {
        &self.format
    }
}

impl<F> DerefMut for LoaderOptions<F> {
    fn deref_mut(&mut self) -> &mut F {
        &mut self.format
    }
}

/// One value of a [`LoaderState`]'s format-specific part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateValue {
    /// A count, size or seed.
    UInt(u64),
    /// A signed integer (a recorded layer value).
    Int(i64),
    /// A flag.
    Bool(bool),
    /// A name (an order, a split, a token selection).
    Str(String),
    /// A list of small integers (labels).
    List(Vec<u64>),
    /// Anything else a saved state held, as its text (refused as the wrong type when read).
    Other(String),
}

impl std::fmt::Display for StateValue {
    /// As a refusal names it: `5`, `true`, `block`, `[0, 2]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateValue::UInt(v) => write!(f, "{v}"),
            StateValue::Int(v) => write!(f, "{v}"),
            StateValue::Bool(v) => write!(f, "{v}"),
            StateValue::Str(v) | StateValue::Other(v) => f.write_str(v),
            StateValue::List(v) => write!(f, "{v:?}"),
        }
    }
}

/// A loader's resumable position, the same shape for every format: what `state()` returns and
/// `load_state` takes. A loader refuses a state taken by a loader that would serve other rows,
/// naming each parameter that differs with both values; a state saved by an older version,
/// with fewer keys, is checked on those it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderState {
    /// The format that took it (`"saev"`, `"flat_tokens"`, `"eagle3"`; empty when unknown, as
    /// in states saved before it was recorded).
    pub format: String,
    /// Shuffle seed.
    pub seed: u64,
    /// The epoch being served (a state saved after an epoch's last batch keeps that epoch,
    /// with `batch` equal to the batches per epoch).
    pub epoch: u64,
    /// The next batch of the epoch on each rank (0-based): the one the next pass yields.
    pub batch: u64,
    /// Rows (samples) per batch on each rank.
    pub batch_size: u64,
    /// Number of ranks.
    pub world_size: u64,
    /// The format's own keys, in the order its saved states list them: its exact position
    /// (saev `cursor`, flat-tokens `step`) and the parameters that decide the order.
    pub params: Vec<(String, StateValue)>,
}

impl LoaderState {
    /// The common position, without format-specific keys.
    pub fn new(
        format: &str,
        seed: u64,
        epoch: u64,
        batch: u64,
        batch_size: u64,
        world_size: u64,
    ) -> LoaderState {
        LoaderState {
            format: format.to_string(),
            seed,
            epoch,
            batch,
            batch_size,
            world_size,
            params: Vec::new(),
        }
    }

    /// Key `k` of the format-specific part.
    pub fn get(&self, k: &str) -> Option<&StateValue> {
        self.params.iter().find(|(n, _)| n == k).map(|(_, v)| v)
    }

    /// Sets key `k` (in place when present, else last).
    pub fn set(&mut self, k: &str, v: StateValue) {
        match self.params.iter_mut().find(|(n, _)| n == k) {
            Some(slot) => slot.1 = v,
            None => self.params.push((k.to_string(), v)),
        }
    }

    /// Removes key `k` (as a state saved before it was recorded lacks it).
    pub fn remove(&mut self, k: &str) -> Option<StateValue> {
        let i = self.params.iter().position(|(n, _)| n == k)?;
        Some(self.params.remove(i).1)
    }

    /// `self` with key `k` set.
    pub(crate) fn with(mut self, k: &str, v: StateValue) -> LoaderState {
        self.set(k, v);
        self
    }

    /// Key `k` read with `read`, when the state has it; another type is an error naming it.
    pub(crate) fn read<'a, T>(
        &'a self,
        k: &str,
        read: impl Fn(&'a StateValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => read(v).map(Some).ok_or_else(|| {
                Error::Invalid(format!(
                    "state key {k:?} has a value of the wrong type: {v}"
                ))
            }),
        }
    }

    /// Key `k` as a non-negative integer.
    pub fn uint(&self, k: &str) -> Result<Option<u64>> {
        self.read(k, |v| match *v {
            StateValue::UInt(x) => Some(x),
            StateValue::Int(x) => u64::try_from(x).ok(),
            _ => None,
        })
    }

    /// Key `k` as a flag.
    pub(crate) fn flag(&self, k: &str) -> Result<Option<bool>> {
        self.read(k, |v| match *v {
            StateValue::Bool(x) => Some(x),
            _ => None,
        })
    }

    /// Key `k` as a name.
    pub fn name(&self, k: &str) -> Result<Option<&str>> {
        self.read(k, |v| match v {
            StateValue::Str(s) => Some(s.as_str()),
            _ => None,
        })
    }

    /// Refuses a state another format's loader took.
    pub(crate) fn check_format(&self, mine: &str) -> Result<()> {
        if self.format.is_empty() || self.format == mine {
            return Ok(());
        }
        Err(Error::Invalid(format!(
            "this state was saved by a {} loader, not a {mine} one",
            self.format
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_maps_onto_the_order_and_keeps_a_shuffled_one() {
        let mut o = LoaderOptions::with_format(4, ());
        assert_eq!(o.order, DEFAULT_ORDER);
        o.set_shuffle(false);
        assert_eq!((o.order, o.shuffled()), (Order::Sequential, false));
        o.set_shuffle(true);
        assert_eq!(o.order, DEFAULT_ORDER);
        o.order = Order::Exact;
        o.set_shuffle(true);
        assert_eq!(o.order, Order::Exact);
    }

    #[test]
    fn state_keys_keep_their_order_and_are_read_by_type() {
        let mut st = LoaderState::new("saev", 1, 2, 3, 4, 5)
            .with("cursor", StateValue::UInt(12))
            .with("order", StateValue::Str("block".into()));
        st.set("cursor", StateValue::UInt(8));
        st.set("rows", StateValue::List(vec![0, 2]));
        let keys: Vec<&str> = st.params.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["cursor", "order", "rows"]);
        assert_eq!(st.uint("cursor").unwrap(), Some(8));
        assert_eq!(st.name("order").unwrap(), Some("block"));
        assert_eq!(st.flag("drop_last").unwrap(), None);
        let err = st.uint("order").unwrap_err().to_string();
        assert!(
            err.contains("state key \"order\" has a value of the wrong type: block"),
            "{err}"
        );
        assert_eq!(st.get("rows").unwrap().to_string(), "[0, 2]");
        assert!(st.check_format("saev").is_ok());
        let err = st.check_format("eagle3").unwrap_err().to_string();
        assert!(
            err.contains("saved by a saev loader, not a eagle3 one"),
            "{err}"
        );
        assert_eq!(st.remove("order"), Some(StateValue::Str("block".into())));
        assert_eq!(st.get("order"), None);
    }
}
