//! A small reader for the kernel's BTF (`/sys/kernel/btf/vmlinux`): just enough to name the
//! values of an enum (`enum skb_drop_reason`) and to find a struct member's byte offset through
//! anonymous unions/structs (`struct sk_buff` → `dev`), so the agent's eBPF program can read
//! `skb->dev->ifindex` on any kernel without CO-RE support in aya-ebpf.
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error("not BTF data (bad magic or header)")]
    BadHeader,
    #[error("BTF data truncated at byte {0}")]
    Truncated(usize),
    #[error("unknown BTF kind {kind} at type id {id}")]
    UnknownKind { kind: u32, id: u32 },
    #[error("no {kind} named {name:?} in BTF")]
    NotFound { kind: &'static str, name: String },
}

const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

#[derive(Debug, Clone)]
struct Member {
    name: u32,
    type_id: u32,
    bit_offset: u32,
}

#[derive(Debug, Clone)]
struct Type {
    name: u32,
    kind: u32,
    /// size, or referenced type id for modifiers/typedefs.
    size_or_type: u32,
    members: Vec<Member>,
    enum_values: Vec<(u32, i64)>,
}

/// Parsed type section plus string table.
pub struct Btf {
    types: Vec<Type>, // index = type id - 1
    strings: Vec<u8>,
}

fn u32_at(b: &[u8], off: usize) -> Result<u32, BtfError> {
    b.get(off..off + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or(BtfError::Truncated(off))
}

impl Btf {
    /// Parses little-endian BTF (the only kind on the machines stepguard supports).
    pub fn parse(data: &[u8]) -> Result<Self, BtfError> {
        if data.len() < 24 || data[0..2] != [0x9f, 0xeb] {
            return Err(BtfError::BadHeader);
        }
        let hdr_len = u32_at(data, 4)? as usize;
        let type_off = u32_at(data, 8)? as usize;
        let type_len = u32_at(data, 12)? as usize;
        let str_off = u32_at(data, 16)? as usize;
        let str_len = u32_at(data, 20)? as usize;
        let tstart = hdr_len + type_off;
        let tend = tstart + type_len;
        let sstart = hdr_len + str_off;
        let strings = data
            .get(sstart..sstart + str_len)
            .ok_or(BtfError::Truncated(sstart))?
            .to_vec();
        if tend > data.len() {
            return Err(BtfError::Truncated(tend));
        }
        let mut types = Vec::new();
        let mut off = tstart;
        while off < tend {
            let name = u32_at(data, off)?;
            let info = u32_at(data, off + 4)?;
            let size_or_type = u32_at(data, off + 8)?;
            off += 12;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 == 1;
            let mut t = Type {
                name,
                kind,
                size_or_type,
                members: vec![],
                enum_values: vec![],
            };
            match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => off += 4,
                KIND_ARRAY => off += 12,
                KIND_STRUCT | KIND_UNION => {
                    for _ in 0..vlen {
                        let raw = u32_at(data, off + 8)?;
                        let bit_offset = if kind_flag { raw & 0x00ff_ffff } else { raw };
                        t.members.push(Member {
                            name: u32_at(data, off)?,
                            type_id: u32_at(data, off + 4)?,
                            bit_offset,
                        });
                        off += 12;
                    }
                }
                KIND_ENUM => {
                    for _ in 0..vlen {
                        let v = u32_at(data, off + 4)?;
                        let v = if kind_flag { v as i64 } else { v as i32 as i64 };
                        t.enum_values.push((u32_at(data, off)?, v));
                        off += 8;
                    }
                }
                KIND_ENUM64 => {
                    for _ in 0..vlen {
                        let lo = u32_at(data, off + 4)? as u64;
                        let hi = u32_at(data, off + 8)? as u64;
                        t.enum_values
                            .push((u32_at(data, off)?, ((hi << 32) | lo) as i64));
                        off += 12;
                    }
                }
                KIND_FUNC_PROTO => off += 8 * vlen,
                KIND_DATASEC => off += 12 * vlen,
                KIND_PTR | 7 | KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | 12
                | 16 | KIND_TYPE_TAG => {}
                k => {
                    return Err(BtfError::UnknownKind {
                        kind: k,
                        id: types.len() as u32 + 1,
                    })
                }
            }
            types.push(t);
        }
        Ok(Self { types, strings })
    }

    fn name(&self, off: u32) -> &str {
        let s = &self.strings[(off as usize).min(self.strings.len())..];
        let end = s.iter().position(|&b| b == 0).unwrap_or(s.len());
        std::str::from_utf8(&s[..end]).unwrap_or("")
    }

    fn ty(&self, id: u32) -> Option<&Type> {
        id.checked_sub(1).and_then(|i| self.types.get(i as usize))
    }

    /// Follows typedefs and qualifiers to the underlying type.
    fn resolve(&self, mut id: u32) -> Option<&Type> {
        for _ in 0..32 {
            let t = self.ty(id)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.size_or_type
                }
                _ => return Some(t),
            }
        }
        None
    }

    /// Values of the named enum (ENUM or ENUM64), value → name.
    pub fn enum_values(&self, enum_name: &str) -> Result<BTreeMap<i64, String>, BtfError> {
        let t = self
            .types
            .iter()
            .find(|t| {
                (t.kind == KIND_ENUM || t.kind == KIND_ENUM64) && self.name(t.name) == enum_name
            })
            .ok_or_else(|| BtfError::NotFound {
                kind: "enum",
                name: enum_name.into(),
            })?;
        Ok(t.enum_values
            .iter()
            .map(|(n, v)| (*v, self.name(*n).to_string()))
            .collect())
    }

    /// Byte offset of `member` in `struct struct_name`, looking through anonymous members.
    pub fn member_offset(&self, struct_name: &str, member: &str) -> Result<u32, BtfError> {
        let t = self
            .types
            .iter()
            .find(|t| {
                t.kind == KIND_STRUCT && self.name(t.name) == struct_name && !t.members.is_empty()
            })
            .ok_or_else(|| BtfError::NotFound {
                kind: "struct",
                name: struct_name.into(),
            })?;
        self.find_member(t, member, 0, 0)
            .map(|bits| bits / 8)
            .ok_or_else(|| BtfError::NotFound {
                kind: "member",
                name: format!("{struct_name}.{member}"),
            })
    }

    fn find_member(&self, t: &Type, member: &str, base_bits: u32, depth: u32) -> Option<u32> {
        if depth > 8 {
            return None;
        }
        for m in &t.members {
            let name = self.name(m.name);
            if name == member {
                return Some(base_bits + m.bit_offset);
            }
            if name.is_empty() {
                if let Some(inner) = self.resolve(m.type_id) {
                    if inner.kind == KIND_STRUCT || inner.kind == KIND_UNION {
                        if let Some(o) =
                            self.find_member(inner, member, base_bits + m.bit_offset, depth + 1)
                        {
                            return Some(o);
                        }
                    }
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds BTF by hand: strings, then types, with the standard 24-byte header.
    struct Builder {
        strings: Vec<u8>,
        types: Vec<u8>,
    }
    impl Builder {
        fn new() -> Self {
            Self {
                strings: vec![0],
                types: vec![],
            }
        }
        fn s(&mut self, s: &str) -> u32 {
            let off = self.strings.len() as u32;
            self.strings.extend_from_slice(s.as_bytes());
            self.strings.push(0);
            off
        }
        fn w(&mut self, v: u32) {
            self.types.extend_from_slice(&v.to_le_bytes());
        }
        fn build(&self) -> Vec<u8> {
            let mut d = vec![0x9f, 0xeb, 1, 0];
            d.extend_from_slice(&24u32.to_le_bytes());
            d.extend_from_slice(&0u32.to_le_bytes());
            d.extend_from_slice(&(self.types.len() as u32).to_le_bytes());
            d.extend_from_slice(&(self.types.len() as u32).to_le_bytes());
            d.extend_from_slice(&(self.strings.len() as u32).to_le_bytes());
            d.extend_from_slice(&self.types);
            d.extend_from_slice(&self.strings);
            d
        }
    }

    #[test]
    fn names_enum_values_and_finds_members_inside_anonymous_unions() {
        let mut b = Builder::new();
        // [1] int
        let int = b.s("int");
        b.w(int);
        b.w(KIND_INT << 24);
        b.w(4);
        b.w(32);
        // [2] enum skb_drop_reason { NOT_SPECIFIED = 2, NO_SOCKET = 3 }
        let (e, a, c) = (
            b.s("skb_drop_reason"),
            b.s("SKB_DROP_REASON_NOT_SPECIFIED"),
            b.s("SKB_DROP_REASON_NO_SOCKET"),
        );
        b.w(e);
        b.w((KIND_ENUM << 24) | 2);
        b.w(4);
        b.w(a);
        b.w(2);
        b.w(c);
        b.w(3);
        // [3] anonymous union { int dev; int scratch; }
        let (dev, scratch) = (b.s("dev"), b.s("dev_scratch"));
        b.w(0);
        b.w((KIND_UNION << 24) | 2);
        b.w(8);
        b.w(dev);
        b.w(1);
        b.w(0);
        b.w(scratch);
        b.w(1);
        b.w(0);
        // [4] struct sk_buff { int next (0); <anon union> (bit 128); }
        let (skb, next) = (b.s("sk_buff"), b.s("next"));
        b.w(skb);
        b.w((KIND_STRUCT << 24) | 2);
        b.w(64);
        b.w(next);
        b.w(1);
        b.w(0);
        b.w(0);
        b.w(3);
        b.w(128);
        let btf = Btf::parse(&b.build()).unwrap();
        let v = btf.enum_values("skb_drop_reason").unwrap();
        assert_eq!(
            v.get(&3).map(String::as_str),
            Some("SKB_DROP_REASON_NO_SOCKET")
        );
        assert_eq!(btf.member_offset("sk_buff", "dev").unwrap(), 16);
        assert!(matches!(
            btf.member_offset("sk_buff", "nope"),
            Err(BtfError::NotFound { .. })
        ));
        assert!(matches!(
            btf.enum_values("nope"),
            Err(BtfError::NotFound { .. })
        ));
    }

    #[test]
    fn rejects_garbage_and_truncation() {
        assert!(matches!(
            Btf::parse(b"hello world, not btf at all"),
            Err(BtfError::BadHeader)
        ));
        let mut b = Builder::new();
        let n = b.s("x");
        b.w(n);
        b.w((KIND_STRUCT << 24) | 5); // claims 5 members, has none
        b.w(4);
        let mut d = b.build();
        d.truncate(24 + 12);
        assert!(Btf::parse(&d).is_err());
    }

    #[test]
    fn reads_the_running_kernels_btf_when_present() {
        let Ok(data) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            panic!("/sys/kernel/btf/vmlinux is missing: this machine is documented to have BTF");
        };
        let btf = Btf::parse(&data).unwrap();
        let reasons = btf.enum_values("skb_drop_reason").unwrap();
        assert!(reasons.values().any(|n| n == "SKB_DROP_REASON_NO_SOCKET"));
        let dev = btf.member_offset("sk_buff", "dev").unwrap();
        assert!(dev > 0 && dev < 256, "sk_buff.dev at {dev}");
        btf.member_offset("net_device", "ifindex").unwrap();
    }
}
