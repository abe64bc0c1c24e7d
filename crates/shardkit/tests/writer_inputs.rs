//! Writers refuse values their format cannot store (issue 32, class 2): each rule gives
//! `Error::Refused` naming the field, where, the value and what is allowed; nothing of a refused
//! write is stored, and the write continues and completes afterwards. (EAGLE-3's rules, and
//! `validate --deep` applying them to what other tools wrote: the unit tests in
//! `src/eagle3/tests/writer_inputs.rs`.)

use shardkit::Error;

#[test]
fn flat_tokens_refuse_ids_past_the_encoding_and_append_nothing() {
    use shardkit::flat_tokens::{Split, Writer, WriterOptions, MAX_TOKEN_ID};
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("t.zarr");
    let mut w = Writer::create(&root, "train", WriterOptions::default()).unwrap();
    w.append(&[vec![1u32, 2, 3]]).unwrap();
    let err = w
        .append(&[vec![4u32], vec![5, MAX_TOKEN_ID + 1]])
        .unwrap_err();
    let Error::Refused {
        field,
        at,
        value,
        allowed,
        ..
    } = &err
    else {
        panic!("{err:?}");
    };
    assert_eq!(field, "token ids");
    assert_eq!(at, "sequence 1 of this append, position 1");
    assert_eq!(value, "2147483648");
    assert!(allowed.contains("0 to 2147483647"), "{allowed}");
    assert_eq!(
        (w.info().seq_count, w.info().token_count),
        (1, 3),
        "nothing appended"
    );
    w.append(&[vec![4u32, MAX_TOKEN_ID]]).unwrap();
    w.finish().unwrap();
    let s = Split::open(&root, "train").unwrap();
    assert_eq!(s.info().seq_count, 2);
    assert_eq!(s.ids(1).unwrap(), vec![4, MAX_TOKEN_ID]);
}

#[test]
fn sdnb_refuses_bool_bytes_other_than_0_and_1() {
    use shardkit::sdnb::{self, DType, Order, SaveOptions, TensorIn, VarType};
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.sdnb");
    let t = |bytes: &'static [u8]| TensorIn {
        name: "mask".into(),
        var_type: VarType::Variable,
        dtype: DType::Bool,
        shape: vec![3],
        order: Order::C,
        bytes,
    };
    let err = sdnb::save(&path, &[t(&[1, 0, 2])], &SaveOptions::default()).unwrap_err();
    let Error::Refused {
        field, at, value, ..
    } = &err
    else {
        panic!("{err:?}");
    };
    assert_eq!(
        (field.as_str(), at.as_str(), value.as_str()),
        ("mask", "element 2", "byte 2")
    );
    assert!(err.to_string().contains("0 or 1"), "{err}");
    assert!(!path.exists(), "nothing written");
    sdnb::save(&path, &[t(&[1, 0, 1])], &SaveOptions::default()).unwrap();
    assert!(sdnb::validate(&path, true).is_valid());
}
