//! A flat-tokens loader's state on the loader contract ([`LoaderState`]): the common position
//! (the step within its epoch), seqax's global `step`, and the parameters that decide which
//! rows a step holds. The loader itself is addressed by step ([`TokenLoader::iter`]); whoever
//! iterates it keeps the position and asks for the state there.

use crate::engine::dist::refuse;
use crate::engine::{LoaderState, StateValue};
use crate::error::{Error, Result};
use crate::flat_tokens::{Packing, TokenLoader};

/// The format's name in a [`LoaderState`].
const FORMAT: &str = "flat_tokens";

impl TokenLoader {
    /// The state when the next step is `step` (counted across epochs) and the loader serves
    /// `epoch`: the common position (`batch` is the step within `epoch`, `batch_size` this
    /// host's rows, `world_size` the hosts), then `step` (seqax's global step) and the
    /// parameters that decide which rows a step holds ([`TokenLoader::order_params`]).
    pub fn state_at(&self, epoch: u64, step: u64) -> LoaderState {
        let o = self.options();
        let (_, hosts) = o.host();
        let mut st = LoaderState::new(
            FORMAT,
            o.seed,
            epoch,
            step.saturating_sub(epoch.saturating_mul(self.step_count())),
            o.batch_size / hosts.max(1),
            hosts,
        );
        st.set("step", StateValue::UInt(step));
        for (k, v) in self.order_params() {
            if k != "seed" {
                st.set(k, v);
            }
        }
        st
    }

    /// The parameters that decide which rows each step holds, in the order a state is checked
    /// on them: `split`, `step_count`, `seq_len`, `global_batch_size`, `packed`, `streams`,
    /// `read_blocks_per_shuffle_buffer`, `sequences_per_read_block`, `seed`, `epochs`.
    pub(crate) fn order_params(&self) -> Vec<(&'static str, StateValue)> {
        let o = self.options();
        let split = self
            .split()
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let uint = StateValue::UInt;
        vec![
            ("split", StateValue::Str(split)),
            ("step_count", uint(self.step_count())),
            ("seq_len", uint(o.seq_len)),
            ("global_batch_size", uint(o.batch_size)),
            ("packed", StateValue::Bool(o.packing == Packing::Packed)),
            ("streams", uint(o.streams)),
            (
                "read_blocks_per_shuffle_buffer",
                uint(o.read_blocks_per_shuffle_buffer),
            ),
            (
                "sequences_per_read_block",
                uint(o.shuffle_params().sequences_per_read_block),
            ),
            ("seed", uint(o.seed)),
            ("epochs", StateValue::Bool(o.epochs)),
        ]
    }

    /// The global step a saved state resumes at: its `step`, else `epoch × step_count +
    /// batch`. A state taken by a loader that would serve other rows (another split, dataset
    /// size, seed, seq_len, global batch, packing, streams or shuffle buffer) is refused,
    /// naming each key that differs with both values (as Python writes them: the state's
    /// readers are Python's); `world_size` may differ when the global batch is the same. A
    /// state saved before `global_batch_size` was recorded held the global batch in
    /// `batch_size`.
    pub fn resume_step(&self, st: &LoaderState) -> Result<u64> {
        st.check_format(FORMAT)?;
        let mut diff = Vec::new();
        for (k, mine) in self.order_params() {
            let theirs = match k {
                "seed" => Some(StateValue::UInt(st.seed)),
                "global_batch_size" => Some(
                    st.get(k)
                        .cloned()
                        .unwrap_or(StateValue::UInt(st.batch_size)),
                ),
                _ => st.get(k).cloned(),
            };
            if let Some(theirs) = theirs.filter(|t| *t != mine) {
                diff.push(format!(
                    "{k}: state {}, this loader {}",
                    py_repr(&theirs),
                    py_repr(&mine)
                ));
            }
        }
        refuse(diff)?;
        let n = self.step_count();
        let step = match st.get("step") {
            Some(StateValue::Int(s)) if *s < 0 => {
                return Err(past(&s.to_string(), n));
            }
            Some(_) => st.uint("step")?.unwrap_or(0),
            None => st.epoch.saturating_mul(n).saturating_add(st.batch),
        };
        if step > n && !self.options().epochs {
            return Err(past(&step.to_string(), n));
        }
        Ok(step)
    }
}

/// A step past the end of a loader without epochs.
fn past(step: &str, n: u64) -> Error {
    Error::Invalid(format!(
        "the state's step {step} is past this loader's {n} steps (epochs=False)"
    ))
}

/// A value as Python's `repr` shows it (`True`, `'train'`, `16`).
fn py_repr(v: &StateValue) -> String {
    match v {
        StateValue::Bool(true) => "True".into(),
        StateValue::Bool(false) => "False".into(),
        StateValue::Str(s) => format!("'{s}'"),
        other => other.to_string(),
    }
}
