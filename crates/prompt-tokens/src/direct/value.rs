//! Values during a rendering, and the comparisons on them.

use std::rc::Rc;

use minijinja::value::{Value, ValueKind};

use super::tree::Cmp;
use super::{Step, declined};
use crate::request::small_map_entries;

static UNDEFINED: Value = Value::UNDEFINED;

/// A value during a rendering: borrowed from the template or the context
/// where possible, owned where computed.
#[derive(Clone)]
pub(super) enum V<'a> {
    Ref(&'a Value),
    Own(Value),
    /// A `namespace()` object: an index into [`Run::namespaces`].
    Ns(usize),
    /// A slice of a borrowed sequence (`messages[1:]`), not copied.
    Slice(&'a [Value]),
    /// Sequences joined with `+`: minijinja's lazy concatenation.
    Chain(Rc<Chain>),
}

/// What minijinja's `+` makes of two sequences (its `MergeSeq`): an
/// iterable, not a sequence (`is sequence` is false, an index takes the
/// `nth` item), of known length, true when not empty. Held here as its
/// items, flattened, and the nesting depth minijinja counts: a `+` whose
/// result would nest deeper than [`MERGE_MAX_DEPTH`] makes a plain list.
pub(super) struct Chain {
    pub(super) items: Vec<Value>,
    /// 1 for a `+` of two plain sequences, one more for each `+` that
    /// takes a chain as an operand.
    pub(super) depth: usize,
}

/// minijinja's `MergeSeq::MAX_DEPTH`: deeper concatenations are made
/// into a list at once.
pub(super) const MERGE_MAX_DEPTH: usize = 32;

impl<'a> V<'a> {
    pub(super) fn value(&self) -> Step<&Value> {
        match self {
            V::Ref(v) => Ok(v),
            V::Own(v) => Ok(v),
            V::Ns(_) | V::Slice(_) | V::Chain(_) => Err(declined!()),
        }
    }

    /// The items when the value is a sequence of plain vector shape.
    pub(super) fn items(&self) -> Option<&[Value]> {
        match self {
            V::Ref(v) => items(v),
            V::Own(v) => items(v),
            V::Slice(list) => Some(list),
            V::Chain(chain) => Some(&chain.items),
            V::Ns(_) => None,
        }
    }

    /// The items borrowed for the whole rendering, when they are.
    pub(super) fn borrowed_items(&self) -> Option<&'a [Value]> {
        match *self {
            V::Ref(v) => items(v),
            V::Slice(list) => Some(list),
            _ => None,
        }
    }

    pub(super) fn undefined() -> Self {
        V::Ref(&UNDEFINED)
    }

    pub(super) fn bool(yes: bool) -> Self {
        V::Own(Value::from(yes))
    }
}

/// The items of a sequence value, when it is one minijinja would index
/// and iterate as a plain vector.
pub(super) fn vec_items(value: &Value) -> Option<&[Value]> {
    items(value)
}

fn items(value: &Value) -> Option<&[Value]> {
    if value.kind() != ValueKind::Seq {
        return None;
    }
    value.downcast_object_ref::<Vec<Value>>().map(Vec::as_slice)
}

/// An integer, when `value` is one that prints and compares as an `i64`.
pub(super) fn int(value: &Value) -> Option<i64> {
    if value.kind() == ValueKind::Number && value.is_integer() {
        value.as_i64()
    } else {
        None
    }
}

/// `left op right` as minijinja decides it, for the operand kinds where
/// that is plain; declines on the rest.
pub(super) fn compare(left: &Value, op: Cmp, right: &Value) -> Step<bool> {
    Ok(match op {
        Cmp::Eq => left == right,
        Cmp::Ne => left != right,
        Cmp::Lt | Cmp::Lte | Cmp::Gt | Cmp::Gte => {
            let (l, r) = (
                int(left).ok_or(declined!())?,
                int(right).ok_or(declined!())?,
            );
            match op {
                Cmp::Lt => l < r,
                Cmp::Lte => l <= r,
                Cmp::Gt => l > r,
                _ => l >= r,
            }
        }
        Cmp::In | Cmp::NotIn => {
            let found = contains(right, left)?;
            if matches!(op, Cmp::In) { found } else { !found }
        }
    })
}

fn contains(container: &Value, item: &Value) -> Step<bool> {
    // minijinja: nothing is in an undefined value.
    if container.is_undefined() {
        return Ok(false);
    }
    if let Some(list) = items(container) {
        return Ok(list.iter().any(|x| x == item));
    }
    if container.kind() == ValueKind::String && item.kind() == ValueKind::String {
        let (haystack, needle) = (
            container.as_str().ok_or(declined!())?,
            item.as_str().ok_or(declined!())?,
        );
        return Ok(haystack.contains(needle));
    }
    if let Some(entries) = small_map_entries(container) {
        return Ok(entries.iter().any(|(k, _)| k == item));
    }
    if container.kind() == ValueKind::Map && item.kind() == ValueKind::String {
        // Any other mapping here is minijinja's own (a dict literal, a
        // large object of the request): minijinja asks it for the key.
        // A key equal to `item` among its keys is what its lookup finds;
        // found, the value it holds must be defined to tell it apart from
        // a missing one, else this declines.
        let keys = container.try_iter().map_err(|_| declined!())?;
        let mut found = false;
        for key in keys {
            if key.kind() != ValueKind::String {
                return Err(declined!());
            }
            found |= key == *item;
        }
        if found
            && container
                .get_item(item)
                .map_err(|_| declined!())?
                .is_undefined()
        {
            return Err(declined!());
        }
        return Ok(found);
    }
    Err(declined!())
}
