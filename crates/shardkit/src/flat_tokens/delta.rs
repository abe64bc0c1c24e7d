//! numcodecs' `delta` filter for zarrs (flat_tokens.md §3.4), which zarrs lacks and seqax puts
//! on `seq_starts`: each chunk stores `x[0], x[1]-x[0], …` of its little-endian i64 words (the
//! padding included), with wrap-around. Registered at run time under the V2 id `delta`.

use std::num::NonZeroU64;
use std::sync::{Arc, Once};

use zarrs::array::codec::api::{
    register_codec_v2, ArrayBytes, ArrayCodecTraits, ArrayToArrayCodecTraits, Codec, CodecError,
    CodecMetadataOptions, CodecOptions, CodecRuntimePluginV2, CodecTraits,
    PartialDecoderCapability, PartialEncoderCapability, RecommendedConcurrency,
};
use zarrs::array::{DataType, FillValue};
use zarrs::metadata::Configuration;
use zarrs::plugin::{PluginCreateError, ZarrVersion};

/// The `delta` codec with `dtype = astype = "<i8"`, the only configuration seqax writes.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DeltaCodec;

impl zarrs::plugin::ExtensionName for DeltaCodec {
    fn name(&self, version: ZarrVersion) -> Option<std::borrow::Cow<'static, str>> {
        Some(match version {
            ZarrVersion::V2 => "delta".into(),
            _ => "numcodecs.delta".into(),
        })
    }
}

impl CodecTraits for DeltaCodec {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn configuration(&self, _: ZarrVersion, _: &CodecMetadataOptions) -> Option<Configuration> {
        let mut m = serde_json::Map::new();
        m.insert("dtype".into(), "<i8".into());
        m.insert("astype".into(), "<i8".into());
        Some(Configuration::from(m))
    }
    fn partial_decoder_capability(&self) -> PartialDecoderCapability {
        // A running sum needs the whole chunk.
        PartialDecoderCapability {
            partial_read: false,
            partial_decode: false,
        }
    }
    fn partial_encoder_capability(&self) -> PartialEncoderCapability {
        PartialEncoderCapability {
            partial_encode: false,
        }
    }
}

impl ArrayCodecTraits for DeltaCodec {
    fn recommended_concurrency(
        &self,
        _: &[NonZeroU64],
        _: &DataType,
    ) -> Result<RecommendedConcurrency, CodecError> {
        Ok(RecommendedConcurrency::new_maximum(1))
    }
}

fn words(bytes: &mut [u8]) -> Result<std::slice::ChunksExactMut<'_, u8>, CodecError> {
    if !bytes.len().is_multiple_of(8) {
        return Err(CodecError::Other(format!(
            "delta: a chunk of {} bytes is not whole 8-byte (<i8) words",
            bytes.len()
        )));
    }
    Ok(bytes.chunks_exact_mut(8))
}

fn word(c: &[u8]) -> i64 {
    i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])
}

impl ArrayToArrayCodecTraits for DeltaCodec {
    fn into_dyn(self: Arc<Self>) -> Arc<dyn ArrayToArrayCodecTraits> {
        self
    }
    fn encode<'a>(
        &self,
        bytes: ArrayBytes<'a>,
        _: &[NonZeroU64],
        _: &DataType,
        _: &FillValue,
        _: &CodecOptions,
    ) -> Result<ArrayBytes<'a>, CodecError> {
        let mut b = bytes.into_fixed()?.into_owned();
        let mut prev = 0i64;
        for c in words(&mut b)? {
            let v = word(c);
            c.copy_from_slice(&v.wrapping_sub(prev).to_le_bytes());
            prev = v;
        }
        Ok(b.into())
    }
    fn decode<'a>(
        &self,
        bytes: ArrayBytes<'a>,
        _: &[NonZeroU64],
        _: &DataType,
        _: &FillValue,
        _: &CodecOptions,
    ) -> Result<ArrayBytes<'a>, CodecError> {
        let mut b = bytes.into_fixed()?.into_owned();
        let mut acc = 0i64;
        for c in words(&mut b)? {
            acc = acc.wrapping_add(word(c));
            c.copy_from_slice(&acc.to_le_bytes());
        }
        Ok(b.into())
    }
    fn encoded_data_type(&self, decoded: &DataType) -> Result<DataType, CodecError> {
        Ok(decoded.clone())
    }
}

/// Registers the codec with zarrs (once per process).
pub(crate) fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        register_codec_v2(CodecRuntimePluginV2::new(
            |name| name == "delta",
            |meta: &zarrs::metadata::v2::MetadataV2| -> Result<Codec, PluginCreateError> {
                for key in ["dtype", "astype"] {
                    match meta.configuration().get(key).and_then(|v| v.as_str()) {
                        None | Some("<i8") => {}
                        Some(other) => {
                            return Err(PluginCreateError::Other(format!(
                                "delta filter with {key} {other:?}: only \"<i8\" (what seqax \
                                 writes) is supported"
                            )))
                        }
                    }
                }
                Ok(Codec::ArrayToArray(Arc::new(DeltaCodec)))
            },
        ));
    });
}
