//! A generic MessagePack value, for the fields whose content vLLM leaves
//! open (`extra_keys`: tuples of multimodal identifiers, LoRA names, cache
//! salts and whatever comes next).

/// A MessagePack value of any type. Extension values are not used by vLLM
/// and are rejected by the decoder.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `nil` (Python `None`).
    Nil,
    /// A boolean.
    Bool(bool),
    /// A non-negative integer.
    UInt(u64),
    /// A negative integer.
    Int(i64),
    /// A float (32-bit floats are widened).
    Float(f64),
    /// A UTF-8 string.
    Str(String),
    /// A byte string.
    Bytes(Vec<u8>),
    /// An array (Python list or tuple).
    Array(Vec<Value>),
    /// A map, in wire order.
    Map(Vec<(Value, Value)>),
}
