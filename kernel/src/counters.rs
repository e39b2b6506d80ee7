//! Per-CPU counter maps, opened read-only: each entry's per-CPU values hold a `u64` count
//! first; the counts are summed over CPUs and grouped by the key's first byte. The caller
//! names the map and the layout it expects (checked against the map's own); what the keys
//! mean is the caller's.
use super::bpf;
use std::collections::BTreeMap;
use std::path::Path;

/// A map's key and (per-CPU) value sizes, in bytes.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub key_size: u32,
    pub value_size: u32,
}

/// The map could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: unexpected layout {key}x{value} (want {want_key}x{want_value})")]
    Layout {
        path: String,
        key: u32,
        value: u32,
        want_key: u32,
        want_value: u32,
    },
}

/// The counts of the map pinned at `path`, summed over CPUs, per first key byte.
pub fn sum_by_first_key_byte(path: &Path, layout: Layout) -> Result<BTreeMap<u8, u64>, ReadError> {
    let io = |what: &'static str| {
        let path = path.display().to_string();
        move |source| ReadError::Io { what, path, source }
    };
    let fd = bpf::obj_get_rdonly(path).map_err(io("open"))?;
    let info = bpf::map_info(&fd).map_err(io("map info"))?;
    if info.key_size != layout.key_size
        || info.value_size != layout.value_size
        || info.key_size == 0
        || info.value_size < 8
    {
        return Err(ReadError::Layout {
            path: path.display().to_string(),
            key: info.key_size,
            value: info.value_size,
            want_key: layout.key_size,
            want_value: layout.value_size,
        });
    }
    // One batched read of the whole map (a step reads it every 100 ms; a real node's
    // `cilium_metrics` holds hundreds of (reason, direction, file, line) entries, and walking
    // them cost two syscalls each).
    let stride = layout.value_size as usize;
    let mut out = BTreeMap::new();
    bpf::for_each_entry(&fd, &info, 4096, |k, value| {
        let count: u64 = value
            .chunks(stride)
            .map(|c| u64::from_ne_bytes(c[..8].try_into().unwrap_or([0; 8])))
            .sum();
        *out.entry(k[0]).or_insert(0) += count;
    })
    .map_err(io("read"))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn possible_cpus_are_parsed_never_guessed() {
        use crate::bpf::parse_possible;
        assert_eq!(parse_possible("0-1\n"), Some(2));
        assert_eq!(parse_possible("0"), Some(1));
        assert_eq!(parse_possible("0-3,8-11"), Some(8));
        assert_eq!(parse_possible(""), None);
        assert_eq!(parse_possible("3-1"), None);
        assert!(crate::bpf::possible_cpus().unwrap() >= 1);
    }
}
