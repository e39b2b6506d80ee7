use super::*;

#[repr(C)]
struct CreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

/// Writes one entry of a map the test created (BPF_MAP_UPDATE_ELEM).
fn update(fd: &OwnedFd, key: &[u8], value: &[u8]) {
    let mut e = ElemAttr {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value_or_next: value.as_ptr() as u64,
        flags: 0,
    };
    bpf(2, &mut e).expect("BPF_MAP_UPDATE_ELEM");
}

/// An LPM trie shaped like `cilium_ipcache` (20-byte keys) with `n` entries (root).
fn lpm_trie(n: u32) -> (OwnedFd, MapInfo) {
    let mut attr = CreateAttr {
        map_type: MAP_TYPE_LPM_TRIE,
        key_size: 20,
        value_size: 8,
        max_entries: 4096,
        map_flags: 1, // BPF_F_NO_PREALLOC, required for LPM tries
    };
    let fd = owned(bpf(0, &mut attr).expect("BPF_MAP_CREATE (needs root)"));
    for i in 0..n {
        let mut key = [0u8; 20];
        key[..4].copy_from_slice(&128u32.to_ne_bytes());
        key[16..20].copy_from_slice(&i.to_be_bytes());
        let value = [0u8; 8];
        update(&fd, &key, &value);
    }
    let info = map_info(&fd).expect("map info");
    (fd, info)
}

/// The kernel's generic batch code (LPM tries) writes a whole key into the batch token:
/// the token must be `key_size` bytes. With the 8-byte token this function used to pass,
/// counting `cilium_ipcache` corrupted the stack and crashed release builds.
#[test]
fn an_lpm_trie_batch_token_is_a_whole_key_and_counting_it_is_exact() {
    let (fd, info) = lpm_trie(300);
    let mut keys = vec![0u8; 64 * 20];
    let mut values = vec![0u8; 64 * 8];
    let mut token = vec![0xaau8; 64];
    let mut attr = BatchAttr {
        in_batch: 0,
        out_batch: token.as_mut_ptr() as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: 64,
        map_fd: fd.as_raw_fd() as u32,
        elem_flags: 0,
        flags: 0,
    };
    bpf(BPF_MAP_LOOKUP_BATCH, &mut attr).expect("batch lookup of an LPM trie");
    assert!(
        token[8..20].iter().any(|b| *b != 0xaa),
        "the kernel wrote past 8 bytes of the token: {token:?}"
    );
    assert!(
        token[20..].iter().all(|b| *b == 0xaa),
        "but not past key_size"
    );
    for _ in 0..3 {
        assert_eq!(count_entries(&fd, &info).unwrap(), Some(300));
    }
}

/// A per-CPU hash shaped like the agent's DROPS map (8-byte keys, a u64 per CPU), bigger
/// than one batch: the batched visit hands out every entry once with every CPU's value,
/// exactly as the key walk does.
#[test]
fn batched_visit_of_a_percpu_hash_equals_the_key_walk() {
    let ncpu = possible_cpus().unwrap();
    let n = 10_000u32;
    let mut attr = CreateAttr {
        map_type: MAP_TYPE_PERCPU_HASH,
        key_size: 8,
        value_size: 8,
        max_entries: 16_384,
        map_flags: 0,
    };
    let fd = owned(bpf(0, &mut attr).expect("BPF_MAP_CREATE (needs root)"));
    for i in 0..n {
        let key = [i.to_ne_bytes(), 7u32.to_ne_bytes()].concat();
        let value: Vec<u8> = (0..ncpu)
            .flat_map(|c| (i as u64 * 10 + c as u64).to_ne_bytes())
            .collect();
        update(&fd, &key, &value);
    }
    let info = map_info(&fd).unwrap();
    let collect = |batched: bool| {
        let mut seen = std::collections::BTreeMap::new();
        let f = |k: &[u8], v: &[u8]| {
            assert_eq!((k.len(), v.len()), (8, 8 * ncpu));
            let key = u32::from_ne_bytes(k[..4].try_into().unwrap());
            let sum: u64 = v
                .chunks(8)
                .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
                .sum();
            assert!(
                seen.insert(key, sum).is_none(),
                "entry {key} handed out twice"
            );
        };
        let count = if batched {
            for_each_batched(&fd, &info, f).unwrap()
        } else {
            for_each_walked(&fd, &info, usize::MAX, f).unwrap()
        };
        assert_eq!(count, n as u64);
        seen
    };
    let (batched, walked) = (collect(true), collect(false));
    assert_eq!(batched.len(), n as usize);
    assert_eq!(batched, walked);
    let c = ncpu as u64;
    assert_eq!(batched[&1234], 1234 * 10 * c + c * (c - 1) / 2);
    // The public entry point, and a limit on it.
    let mut m = 0;
    assert_eq!(for_each_entry(&fd, &info, 100, |_, _| m += 1).unwrap(), 100);
    assert_eq!(m, 100);
    assert_eq!(count_entries(&fd, &info).unwrap(), Some(n as u64));
}
