//! A pickle reader for plain data (protocols 0-5): dicts, lists, tuples,
//! sets, ints, floats, strings, bytes, bools and None. Anything that would
//! run code (globals, REDUCE, BUILD, ...) is refused with the opcode and its
//! offset. Containers are shared through the memo as Python shares them.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// A container shared through the memo.
pub type Shared<T> = Rc<RefCell<Vec<T>>>;

/// A decoded value.
#[derive(Clone, Debug)]
pub enum Value {
    /// None.
    None,
    /// bool.
    Bool(bool),
    /// int that fits 64 bits.
    Int(i64),
    /// float.
    Float(f64),
    /// str.
    Str(Rc<str>),
    /// bytes or bytearray.
    Bytes,
    /// list, tuple, set or frozenset.
    List(Shared<Value>),
    /// dict, in insertion order.
    Dict(Shared<(Value, Value)>),
}

impl Value {
    /// The value under string key `k` of a dict.
    pub fn get(&self, k: &str) -> Option<Value> {
        match self {
            Value::Dict(d) => d
                .borrow()
                .iter()
                .find(|(key, _)| key.as_str() == Some(k))
                .map(|(_, v)| v.clone()),
            _ => None,
        }
    }

    /// The int, if it is one (bools count as 0/1, as in Python).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(i64::from(*b)),
            Value::Float(f) if f.fract() == 0.0 => Some(*f as i64),
            _ => None,
        }
    }

    /// The string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Items of a list or tuple (empty for anything else).
    pub fn items(&self) -> Vec<Value> {
        match self {
            Value::List(l) => l.borrow().clone(),
            _ => Vec::new(),
        }
    }

    /// Python's name for the value's type, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes => "bytes",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
        }
    }

    fn list(v: Vec<Value>) -> Value {
        Value::List(Rc::new(RefCell::new(v)))
    }
}

/// Dropped without recursion: a pickle may nest a million lists, and
/// dropping them one inside the other would overflow the stack.
impl Drop for Value {
    fn drop(&mut self) {
        let mut todo = Vec::new();
        take_children(self, &mut todo);
        while let Some(mut v) = todo.pop() {
            take_children(&mut v, &mut todo);
        }
    }
}

/// Moves the items of a container nothing else shares into `todo`.
fn take_children(v: &mut Value, todo: &mut Vec<Value>) {
    match v {
        Value::List(rc) if Rc::strong_count(rc) == 1 => todo.append(&mut rc.borrow_mut()),
        Value::Dict(rc) if Rc::strong_count(rc) == 1 => {
            for (k, x) in rc.borrow_mut().drain(..) {
                todo.push(k);
                todo.push(x);
            }
        }
        _ => {}
    }
}

enum Slot {
    Mark,
    V(Value),
}

/// Decodes one pickle.
pub fn loads(b: &[u8]) -> Result<Value, String> {
    let mut stack: Vec<Slot> = Vec::new();
    // Sparse: a memo index read from the file must not size an allocation.
    let mut memo: HashMap<usize, Value> = HashMap::new();
    let mut pos = 0usize;
    let take = |pos: &mut usize, n: usize| -> Result<&[u8], String> {
        let end = pos
            .checked_add(n)
            .filter(|&e| e <= b.len())
            .ok_or_else(|| {
                format!(
                    "pickle ends at byte {} inside an item of {n} bytes",
                    b.len()
                )
            })?;
        let s = &b[*pos..end];
        *pos = end;
        Ok(s)
    };
    let le = |s: &[u8]| s.iter().rev().fold(0u64, |a, &x| (a << 8) | u64::from(x));
    loop {
        let at = pos;
        let op = *take(&mut pos, 1)?.first().expect("one byte");
        let pop = |stack: &mut Vec<Slot>| -> Result<Value, String> {
            match stack.pop() {
                Some(Slot::V(v)) => Ok(v),
                _ => Err(format!(
                    "byte {at}: opcode {op:#04x} found no value on the stack"
                )),
            }
        };
        let pop_mark = |stack: &mut Vec<Slot>| -> Result<Vec<Value>, String> {
            let i = stack
                .iter()
                .rposition(|s| matches!(s, Slot::Mark))
                .ok_or_else(|| format!("byte {at}: no MARK"))?;
            let items = stack.split_off(i + 1);
            stack.pop();
            Ok(items
                .into_iter()
                .map(|s| if let Slot::V(v) = s { v } else { Value::None })
                .collect())
        };
        let put = |memo: &mut HashMap<usize, Value>,
                   stack: &Vec<Slot>,
                   idx: usize|
         -> Result<(), String> {
            let Some(Slot::V(v)) = stack.last() else {
                return Err(format!("byte {at}: memo of nothing"));
            };
            memo.insert(idx, v.clone());
            Ok(())
        };
        let v = match op {
            0x80 => {
                let p = take(&mut pos, 1)?[0];
                if p > 5 {
                    return Err(format!("byte {at}: pickle protocol {p} is not supported"));
                }
                continue;
            }
            0x95 => {
                take(&mut pos, 8)?;
                continue;
            }
            b'.' => return pop(&mut stack),
            b'(' => {
                stack.push(Slot::Mark);
                continue;
            }
            b'}' => Value::Dict(Rc::default()),
            b']' => Value::list(Vec::new()),
            b')' => Value::list(Vec::new()),
            0x8f => Value::list(Vec::new()),
            b'd' => {
                let items = pop_mark(&mut stack)?;
                Value::Dict(Rc::new(RefCell::new(pairs(items))))
            }
            b'l' | b't' | 0x91 => Value::list(pop_mark(&mut stack)?),
            0x85 => {
                let a = pop(&mut stack)?;
                Value::list(vec![a])
            }
            0x86 => {
                let b2 = pop(&mut stack)?;
                let a = pop(&mut stack)?;
                Value::list(vec![a, b2])
            }
            0x87 => {
                let c = pop(&mut stack)?;
                let b2 = pop(&mut stack)?;
                let a = pop(&mut stack)?;
                Value::list(vec![a, b2, c])
            }
            b's' => {
                let v = pop(&mut stack)?;
                let k = pop(&mut stack)?;
                dict_top(&stack, at)?.borrow_mut().push((k, v));
                continue;
            }
            b'u' => {
                let items = pop_mark(&mut stack)?;
                dict_top(&stack, at)?.borrow_mut().extend(pairs(items));
                continue;
            }
            b'a' => {
                let v = pop(&mut stack)?;
                list_top(&stack, at)?.borrow_mut().push(v);
                continue;
            }
            b'e' | 0x90 => {
                let items = pop_mark(&mut stack)?;
                list_top(&stack, at)?.borrow_mut().extend(items);
                continue;
            }
            b'J' => Value::Int(i64::from(i32::from_le_bytes(
                take(&mut pos, 4)?.try_into().expect("4"),
            ))),
            b'K' => Value::Int(i64::from(take(&mut pos, 1)?[0])),
            b'M' => Value::Int(le(take(&mut pos, 2)?) as i64),
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    usize::from(take(&mut pos, 1)?[0])
                } else {
                    le(take(&mut pos, 4)?) as usize
                };
                let s = take(&mut pos, n)?;
                if n > 8 {
                    return Err(format!(
                        "byte {at}: integer of {n} bytes does not fit 64 bits"
                    ));
                }
                let neg = s.last().is_some_and(|&x| x >= 0x80);
                let mut full = [if neg { 0xff } else { 0 }; 8];
                full[..n].copy_from_slice(s);
                Value::Int(i64::from_le_bytes(full))
            }
            b'G' => Value::Float(f64::from_be_bytes(
                take(&mut pos, 8)?.try_into().expect("8"),
            )),
            0x88 => Value::Bool(true),
            0x89 => Value::Bool(false),
            b'N' => Value::None,
            0x8c | b'X' | 0x8d => {
                let n = match op {
                    0x8c => usize::from(take(&mut pos, 1)?[0]),
                    b'X' => le(take(&mut pos, 4)?) as usize,
                    _ => usize::try_from(le(take(&mut pos, 8)?))
                        .map_err(|_| format!("byte {at}: string too long"))?,
                };
                let s = std::str::from_utf8(take(&mut pos, n)?)
                    .map_err(|_| format!("byte {at}: string is not UTF-8"))?;
                Value::Str(s.into())
            }
            b'C' | b'B' | 0x8e | 0x96 => {
                let n = match op {
                    b'C' => usize::from(take(&mut pos, 1)?[0]),
                    b'B' => le(take(&mut pos, 4)?) as usize,
                    _ => usize::try_from(le(take(&mut pos, 8)?))
                        .map_err(|_| format!("byte {at}: bytes too long"))?,
                };
                {
                    take(&mut pos, n)?;
                    Value::Bytes
                }
            }
            b'I' | b'L' | b'F' => {
                let end = b[pos..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .ok_or_else(|| format!("byte {at}: unterminated number"))?;
                let text = std::str::from_utf8(&b[pos..pos + end])
                    .map_err(|_| format!("byte {at}: bad number"))?
                    .trim_end_matches('L');
                pos += end + 1;
                match (op, text) {
                    (b'I', "00") => Value::Bool(false),
                    (b'I', "01") => Value::Bool(true),
                    (b'F', t) => Value::Float(
                        t.parse()
                            .map_err(|_| format!("byte {at}: bad float {t:?}"))?,
                    ),
                    (_, t) => {
                        Value::Int(t.parse().map_err(|_| format!("byte {at}: bad int {t:?}"))?)
                    }
                }
            }
            // Protocol 0: PUT and GET with a decimal index, UNICODE in
            // raw-unicode-escape; each ends at a newline.
            b'p' | b'g' | b'V' => {
                let end = b[pos..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .ok_or_else(|| format!("byte {at}: unterminated line"))?;
                let text = &b[pos..pos + end];
                pos += end + 1;
                if op == b'V' {
                    Value::Str(
                        raw_unicode_escape(text)
                            .ok_or_else(|| format!("byte {at}: bad escaped string"))?
                            .into(),
                    )
                } else {
                    let idx = std::str::from_utf8(text)
                        .ok()
                        .and_then(|t| t.parse::<usize>().ok())
                        .ok_or_else(|| format!("byte {at}: bad memo index"))?;
                    if op == b'p' {
                        put(&mut memo, &stack, idx)?;
                        continue;
                    }
                    memo.get(&idx)
                        .cloned()
                        .ok_or_else(|| format!("byte {at}: memo entry {idx} is empty"))?
                }
            }
            0x94 => {
                let n = memo.len();
                put(&mut memo, &stack, n)?;
                continue;
            }
            b'q' | b'r' => {
                let idx = if op == b'q' {
                    usize::from(take(&mut pos, 1)?[0])
                } else {
                    le(take(&mut pos, 4)?) as usize
                };
                put(&mut memo, &stack, idx)?;
                continue;
            }
            b'h' | b'j' => {
                let idx = if op == b'h' {
                    usize::from(take(&mut pos, 1)?[0])
                } else {
                    le(take(&mut pos, 4)?) as usize
                };
                memo.get(&idx)
                    .cloned()
                    .ok_or_else(|| format!("byte {at}: memo entry {idx} is empty"))?
            }
            b'0' => {
                stack.pop();
                continue;
            }
            b'1' => {
                pop_mark(&mut stack)?;
                continue;
            }
            b'2' => match stack.last() {
                Some(Slot::V(v)) => v.clone(),
                _ => return Err(format!("byte {at}: DUP of nothing")),
            },
            other => {
                return Err(format!(
                    "byte {at}: opcode {other:#04x} ({:?}) is not plain data (only dicts, lists, tuples, numbers, strings, bools and None are read)",
                    other as char
                ));
            }
        };
        stack.push(Slot::V(v));
    }
}

/// Python's `raw-unicode-escape`: bytes are Latin-1 characters, except
/// `\uXXXX` and `\UXXXXXXXX`.
fn raw_unicode_escape(b: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let n = match (b[i], b.get(i + 1)) {
            (b'\\', Some(b'u')) => 4,
            (b'\\', Some(b'U')) => 8,
            (c, _) => {
                out.push(char::from(c));
                i += 1;
                continue;
            }
        };
        let hex = std::str::from_utf8(b.get(i + 2..i + 2 + n)?).ok()?;
        out.push(char::from_u32(u32::from_str_radix(hex, 16).ok()?)?);
        i += 2 + n;
    }
    Some(out)
}

fn pairs(items: Vec<Value>) -> Vec<(Value, Value)> {
    let mut it = items.into_iter();
    let mut out = Vec::new();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    out
}

fn dict_top(stack: &[Slot], at: usize) -> Result<&Shared<(Value, Value)>, String> {
    match stack.last() {
        Some(Slot::V(Value::Dict(d))) => Ok(d),
        _ => Err(format!("byte {at}: SETITEM(S) without a dict")),
    }
}

fn list_top(stack: &[Slot], at: usize) -> Result<&Shared<Value>, String> {
    match stack.last() {
        Some(Slot::V(Value::List(l))) => Ok(l),
        _ => Err(format!("byte {at}: APPEND(S) without a list")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_million_nested_lists_decode_and_drop_without_recursion() {
        let n = 1_000_000;
        let mut b = b"\x80\x02".to_vec();
        b.extend(std::iter::repeat_n(b']', n));
        b.extend(std::iter::repeat_n(b'a', n - 1));
        b.push(b'.');
        let v = loads(&b).unwrap();
        assert_eq!(v.items().len(), 1);
        drop(v);
    }

    /// Protocol 0, as Python 3 writes it: `pickle.dumps({"k": [1, "é\\"],
    /// "n": None, "t": True, "f": 1.5, "u": "\u20ac"}, 0)`, with the list
    /// shared through the memo (GET).
    #[test]
    fn reads_protocol_0() {
        let v = loads(
            b"(dp0\nVk\np1\n(lp2\nI1\naV\xe9\\u005c\np3\nasVn\np4\nNsVt\np5\nI01\nsVf\np6\nF1.5\nsVu\np7\nV\\u20ac\np8\nsVk2\np9\ng2\ns.",
        )
        .unwrap();
        let k = v.get("k").unwrap().items();
        assert_eq!(k[0].as_int(), Some(1));
        assert_eq!(k[1].as_str(), Some("\u{e9}\\"));
        assert_eq!(v.get("u").unwrap().as_str(), Some("\u{20ac}"));
        assert_eq!(v.get("t").unwrap().as_int(), Some(1));
        assert_eq!(v.get("k2").unwrap().items().len(), 2);
        assert!(loads(b"(dp0\nVk\np1\ng9\ns.").is_err(), "GET of nothing");
        assert!(loads(b"(dp0\nV\\u12\np1\nI1\ns.").is_err(), "short escape");
    }

    #[test]
    fn refuses_code_and_truncation() {
        // protocol 2: GLOBAL 'os system'
        let e = loads(b"\x80\x02cos\nsystem\n.").unwrap_err();
        assert!(e.contains("not plain data"), "{e}");
        let e = loads(b"\x80\x04}(\x8c\x01a").unwrap_err();
        assert!(e.contains("ends at byte"), "{e}");
        assert!(loads(b"").is_err());
    }

    /// A memo index of 4294967295 (LONG_BINPUT) is stored sparsely, not by
    /// growing a table to that length.
    #[test]
    fn huge_memo_indices_allocate_nothing() {
        // protocol 4: EMPTY_LIST, LONG_BINPUT 0xffffffff, POP, LONG_BINGET 0xffffffff, STOP
        let v = loads(b"\x80\x04]r\xff\xff\xff\xff0j\xff\xff\xff\xff.").unwrap();
        assert!(v.items().is_empty());
    }

    #[test]
    fn shares_memoized_containers() {
        // Python: d = {}; pickle.dumps([d, d], 4) with d filled after the memo.
        let v = loads(
            b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94\x8c\x01k\x94K\x01sh\x01e.",
        )
        .unwrap();
        let items = v.items();
        assert_eq!(items.len(), 2);
        assert_eq!(items[1].get("k").and_then(|x| x.as_int()), Some(1));
    }
}
