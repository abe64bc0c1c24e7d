//! Verification of a FlatGraph region with the `flatbuffers` crate's verifier, one impl per
//! table shardkit reads: every table, vector and string of the parts shardkit interprets
//! (variables, arrays, metadata, updater state, sub-graphs); ops and the configuration table
//! only shallowly (their vtable and extent).

use std::path::Path;

use flatbuffers::{
    ForwardsUOffset, InvalidFlatbuffer, Vector, Verifiable, Verifier, VerifierOptions,
};

use super::{fa, fg, fv, ip, slot};
use crate::error::{Error, Result};

struct FlatGraphV;
struct FlatVariableV;
struct FlatArrayV;
struct IntPairV;
struct BufferChunkV;
struct UpdaterStateV;
struct SubInstanceV;
/// A table shardkit never looks inside: only its vtable and extent are checked.
struct OpaqueV;

type Strings<'a> = Vector<'a, ForwardsUOffset<&'a str>>;
type Tables<'a, T> = Vector<'a, ForwardsUOffset<T>>;
type VResult = std::result::Result<(), InvalidFlatbuffer>;

impl Verifiable for OpaqueV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?.finish();
        Ok(())
    }
}
impl Verifiable for IntPairV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<i32>("first", ip::FIRST, false)?
            .visit_field::<i32>("second", ip::SECOND, false)?
            .finish();
        Ok(())
    }
}
impl Verifiable for BufferChunkV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<i64>("index", slot(0), false)?
            .visit_field::<ForwardsUOffset<Vector<i8>>>("data", slot(1), false)?
            .finish();
        Ok(())
    }
}
impl Verifiable for FlatArrayV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<ForwardsUOffset<Vector<i64>>>("shape", fa::SHAPE, false)?
            .visit_field::<ForwardsUOffset<Vector<i8>>>("buffer", fa::BUFFER, false)?
            .visit_field::<i8>("dtype", fa::DTYPE, false)?
            .visit_field::<i8>("byteOrder", fa::BYTE_ORDER, false)?
            .visit_field::<ForwardsUOffset<Tables<BufferChunkV>>>(
                "bufferChunks",
                fa::BUFFER_CHUNKS,
                false,
            )?
            .visit_field::<i64>("totalBufferSize", fa::TOTAL_BUFFER_SIZE, false)?
            .visit_field::<ForwardsUOffset<Strings>>(
                "externalDataFilename",
                fa::EXTERNAL_FILENAME,
                false,
            )?
            .visit_field::<bool>("isExternal", fa::IS_EXTERNAL, false)?
            .visit_field::<i64>("appendedDataOffset", fa::APPENDED_OFFSET, false)?
            .visit_field::<i64>("appendedDataLength", fa::APPENDED_LENGTH, false)?
            .finish();
        Ok(())
    }
}
impl Verifiable for FlatVariableV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<ForwardsUOffset<IntPairV>>("id", fv::ID, false)?
            .visit_field::<ForwardsUOffset<&str>>("name", fv::NAME, false)?
            .visit_field::<i8>("dtype", fv::DTYPE, false)?
            .visit_field::<ForwardsUOffset<Vector<i64>>>("shape", fv::SHAPE, false)?
            .visit_field::<ForwardsUOffset<FlatArrayV>>("ndarray", fv::NDARRAY, false)?
            .visit_field::<i32>("device", fv::DEVICE, false)?
            .visit_field::<i8>("variabletype", fv::VARIABLETYPE, false)?
            .visit_field::<ForwardsUOffset<Strings>>("controlDeps", fv::CONTROL_DEPS[0], false)?
            .visit_field::<ForwardsUOffset<Strings>>("controlDepForOp", fv::CONTROL_DEPS[1], false)?
            .visit_field::<ForwardsUOffset<Strings>>(
                "controlDepsForVar",
                fv::CONTROL_DEPS[2],
                false,
            )?
            .finish();
        Ok(())
    }
}
impl Verifiable for UpdaterStateV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<ForwardsUOffset<&str>>("paramName", slot(0), false)?
            .visit_field::<ForwardsUOffset<Strings>>("updaterStateKeys", slot(1), false)?
            .visit_field::<ForwardsUOffset<Tables<FlatArrayV>>>(
                "updaterStateValues",
                slot(2),
                false,
            )?
            .finish();
        Ok(())
    }
}
impl Verifiable for SubInstanceV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<ForwardsUOffset<&str>>("name", slot(0), false)?
            .visit_field::<ForwardsUOffset<Vector<u8>>>("serializedData", slot(1), false)?
            .finish();
        Ok(())
    }
}
impl Verifiable for FlatGraphV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<i64>("id", fg::ID, false)?
            .visit_field::<ForwardsUOffset<Tables<FlatVariableV>>>(
                "variables",
                fg::VARIABLES,
                false,
            )?
            .visit_field::<ForwardsUOffset<Tables<OpaqueV>>>("nodes", fg::NODES, false)?
            .visit_field::<ForwardsUOffset<Tables<IntPairV>>>("outputs", fg::OUTPUTS, false)?
            .visit_field::<ForwardsUOffset<OpaqueV>>("configuration", fg::CONFIGURATION, false)?
            .visit_field::<ForwardsUOffset<Strings>>("placeholders", fg::PLACEHOLDERS, false)?
            .visit_field::<ForwardsUOffset<Strings>>("lossVariables", fg::LOSS_VARIABLES, false)?
            .visit_field::<ForwardsUOffset<&str>>("trainingConfig", fg::TRAINING_CONFIG, false)?
            .visit_field::<ForwardsUOffset<Tables<UpdaterStateV>>>(
                "updaterState",
                fg::UPDATER_STATE,
                false,
            )?
            .visit_field::<ForwardsUOffset<Strings>>("metadataKeys", fg::METADATA_KEYS, false)?
            .visit_field::<ForwardsUOffset<Strings>>("metadataValues", fg::METADATA_VALUES, false)?
            .visit_field::<ForwardsUOffset<Tables<SubInstanceV>>>(
                "subInstances",
                fg::SUB_INSTANCES,
                false,
            )?
            .finish();
        Ok(())
    }
}

/// Runs the verifier over a whole graph region.
pub(super) fn verify(region: &[u8], path: &Path) -> Result<()> {
    // Offsets may alias, so a small region can describe a huge tree; bounding the verified
    // size (aliases counted each time) bounds what parsing allocates to a multiple of the
    // region, with room for the sharing a real builder produces.
    let opts = VerifierOptions {
        max_depth: 64,
        max_tables: region.len() / 4 + 1024,
        max_apparent_size: region.len().saturating_mul(4).max(16 << 20),
        ignore_missing_null_terminator: false,
    };
    let mut v = Verifier::new(&opts, region);
    <ForwardsUOffset<FlatGraphV>>::run_verifier(&mut v, 0)
        .map_err(|e| Error::format(path, format!("the FlatGraph fails verification: {e}")))
}
