//! Tests of opening containers.

use super::*;

#[test]
fn fortran_bytes_reorder_to_c() {
    // 2×3 in F order: columns (0,3), (1,4), (2,5) hold the C values 0..6.
    let f: Vec<u8> = vec![0, 3, 1, 4, 2, 5];
    assert_eq!(f_to_c(&f, &[2, 3], 1), vec![0, 1, 2, 3, 4, 5]);
    let f16: Vec<u8> = [0u16, 3, 1, 4, 2, 5]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let c: Vec<u8> = (0u16..6).flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(f_to_c(&f16, &[2, 3], 2), c);
}

#[test]
fn base_names_follow_dl4j() {
    assert_eq!(base_name("a.b.c"), "a.b");
    assert_eq!(base_name(".x"), ".x");
    assert_eq!(base_name("model"), "model");
    assert_eq!(
        base_name("large-samediff-model.bin"),
        "large-samediff-model"
    );
}

#[test]
fn shard_sets_must_be_complete_and_agree() {
    let p = Path::new("m.shard*.sdnb");
    let s = |v: &[(u32, u32)]| complete_set(v.iter().map(|&(i, n)| (i, n, format!("s{i}"))), p);
    assert_eq!(s(&[(1, 2), (0, 2)]).unwrap(), vec![1, 0]);
    assert!(s(&[(0, 3), (2, 3)])
        .unwrap_err()
        .to_string()
        .contains("[1]"));
    assert!(s(&[(0, 2), (1, 3)])
        .unwrap_err()
        .to_string()
        .contains("differ"));
    assert!(s(&[(0, 1), (1, 1)])
        .unwrap_err()
        .to_string()
        .contains("not below"));
    assert!(s(&[(0, 1), (0, 1)])
        .unwrap_err()
        .to_string()
        .contains("twice"));
}
