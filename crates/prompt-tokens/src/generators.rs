//! jinja2's generator filters: `map`, `select`, `reject`, `selectattr`,
//! `rejectattr`, `items`, `unique`, `batch` and `slice` return Python
//! generators, and `reverse` of a list or dict returns Python's
//! `reversed()` iterator, not a list; and such an iterator is not a list
//! in ways a chat template can see:
//!
//! - it is consumed as it is read: a second `for` over it, or a `| list`
//!   after a `| first` or an `in`, sees only what is left;
//! - `tojson` raises (`json` cannot serialise a generator: llama.cpp's
//!   DeepSeek R1 template pipes `tools | map(...)` into `tojson`, and
//!   vLLM answers every request with tools with an error), and so do
//!   `length`, `count` and `last`;
//! - it is always true, indexing it gives an undefined value, and it
//!   prints as `<generator object sync_do_map at 0x...>`.
//!
//! minijinja's filters return sequences. This module registers the same
//! names over minijinja's own filters and hands their items out through a
//! [`Generator`]: an iterable that yields each item once, whoever asks
//! (for loops, `list`, `join`, `first`, `in`, another filter).
//!
//! # Where it still differs
//!
//! - The items are computed when the filter runs, not as they are read:
//!   a mapped filter or test that fails on an item fails even when that
//!   item would never be read (`["1", "x"] | map("int") | first` raises
//!   here, returns 1 in jinja2), and a generator given to one of these
//!   filters is drained at once.
//! - A generator prints with an address-shaped placeholder
//!   ([`ADDRESS`]): Python prints the object's memory address, which no
//!   other process can reproduce.
//! - `==` reads both sides (jinja2 compares a generator by identity), `+`
//!   with a list concatenates and `g[1:]` slices (jinja2 raises for both):
//!   minijinja's operators decide these, and they have no hook.
//! - A tuple written in the template is a list here, so its `reverse`
//!   prints as a `list_reverseiterator` (Python's `reversed` object).

use std::fmt;
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Rest, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, filters};
use parking_lot::Mutex;

/// What a generator prints in place of Python's memory address (the
/// width of a typical x86-64 CPython heap address).
pub(crate) const ADDRESS: &str = "0x7f0000000000";

/// Registers the generator filters, `reverse`, and the `last` filter that
/// refuses a generator.
pub(crate) fn register(env: &mut Environment<'_>) {
    env.add_filter("map", map);
    env.add_filter("select", select);
    env.add_filter("reject", reject);
    env.add_filter("selectattr", selectattr);
    env.add_filter("rejectattr", rejectattr);
    env.add_filter("items", items);
    env.add_filter("unique", unique);
    env.add_filter("batch", batch);
    env.add_filter("slice", slice);
    env.add_filter("reverse", reverse);
    env.add_filter("last", last);
}

/// Which Python object a [`Generator`] stands for.
#[derive(Clone, Copy)]
enum Kind {
    /// A generator, made by the named generator function
    /// (`sync_do_map`, `select_or_reject`, ...).
    Generator(&'static str),
    /// An iterator of the named type (`list_reverseiterator`, ...).
    Iterator(&'static str),
}

impl Kind {
    /// Python's name of the type, as its errors spell it.
    fn type_name(self) -> &'static str {
        match self {
            Kind::Generator(_) => "generator",
            Kind::Iterator(name) => name,
        }
    }
}

/// A Python generator's (or iterator's) items, handed out once: each read
/// takes the next item, from whichever loop or filter reads.
pub(crate) struct Generator {
    kind: Kind,
    /// The items not read yet. A lock, not a cell, because minijinja
    /// values are `Send + Sync`; renderings never share one.
    rest: Mutex<std::vec::IntoIter<Value>>,
}

impl Generator {
    /// A generator value yielding `items`.
    fn value(kind: Kind, items: Vec<Value>) -> Value {
        Value::from_object(Generator {
            kind,
            rest: Mutex::new(items.into_iter()),
        })
    }

    /// A generator made by `function`, yielding what iterating `iterable`
    /// yields now.
    fn drain(function: &'static str, iterable: &Value) -> Result<Value, Error> {
        Ok(Self::value(
            Kind::Generator(function),
            iterable.try_iter()?.collect(),
        ))
    }
}

/// Python's type name of `value` when it is a [`Generator`] (so Python
/// refuses to serialise, measure or reverse it), else `None`.
pub(crate) fn python_type(value: &Value) -> Option<&'static str> {
    value
        .downcast_object_ref::<Generator>()
        .map(|g| g.kind.type_name())
}

impl fmt::Debug for Generator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            Kind::Generator(function) => {
                write!(f, "<generator object {function} at {ADDRESS}>")
            }
            Kind::Iterator(name) => write!(f, "<{name} object at {ADDRESS}>"),
        }
    }
}

impl Object for Generator {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Iterable
    }

    /// Every key is undefined: jinja2 indexes a generator (`g[0]`), fails,
    /// and answers undefined. Without this minijinja would step the
    /// iterator to the index, consuming it.
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let _ = key;
        Some(Value::UNDEFINED)
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Iter(Box::new(Reader(self.clone())))
    }

    /// No length, so `length` and `count` raise, as `len()` of a
    /// generator does. (A loop still learns its length from the reader's
    /// size hint: jinja2's `loop.length` reads the rest of a generator
    /// into a list to count it.)
    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        None
    }

    /// A Python object without `__len__` or `__bool__` is true, empty
    /// or not.
    fn is_true(self: &Arc<Self>) -> bool {
        true
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_ref(), f)
    }
}

/// One iteration of a [`Generator`]: takes items from the shared rest.
struct Reader(Arc<Generator>);

impl Iterator for Reader {
    type Item = Value;

    fn next(&mut self) -> Option<Value> {
        self.0.rest.lock().next()
    }

    /// Exact, so a loop over a generator knows `loop.length`,
    /// `loop.last` and `loop.revindex`, as jinja2's loop does.
    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.0.rest.lock().len();
        (left, Some(left))
    }
}

/// jinja2's `map` (`sync_do_map`).
fn map(state: &State<'_, '_>, value: Value, args: Rest<Value>) -> Result<Value, Error> {
    Ok(Generator::value(
        Kind::Generator("sync_do_map"),
        filters::map(state, value, args)?,
    ))
}

/// jinja2's `select` (`select_or_reject`).
fn select(
    state: &State<'_, '_>,
    value: Value,
    test: Option<std::borrow::Cow<'_, str>>,
    args: Rest<Value>,
) -> Result<Value, Error> {
    Ok(Generator::value(
        Kind::Generator("select_or_reject"),
        filters::select(state, value, test, args)?,
    ))
}

/// jinja2's `reject` (`select_or_reject`).
fn reject(
    state: &State<'_, '_>,
    value: Value,
    test: Option<std::borrow::Cow<'_, str>>,
    args: Rest<Value>,
) -> Result<Value, Error> {
    Ok(Generator::value(
        Kind::Generator("select_or_reject"),
        filters::reject(state, value, test, args)?,
    ))
}

/// jinja2's `selectattr` (`select_or_reject`).
fn selectattr(
    state: &State<'_, '_>,
    value: Value,
    attr: std::borrow::Cow<'_, str>,
    test: Option<std::borrow::Cow<'_, str>>,
    args: Rest<Value>,
) -> Result<Value, Error> {
    Ok(Generator::value(
        Kind::Generator("select_or_reject"),
        filters::selectattr(state, value, attr, test, args)?,
    ))
}

/// jinja2's `rejectattr` (`select_or_reject`).
fn rejectattr(
    state: &State<'_, '_>,
    value: Value,
    attr: std::borrow::Cow<'_, str>,
    test: Option<std::borrow::Cow<'_, str>>,
    args: Rest<Value>,
) -> Result<Value, Error> {
    Ok(Generator::value(
        Kind::Generator("select_or_reject"),
        filters::rejectattr(state, value, attr, test, args)?,
    ))
}

/// jinja2's `items` (`do_items`): a mapping's (key, value) pairs; an
/// undefined value yields nothing, as jinja2's returns early for one.
fn items(value: &Value) -> Result<Value, Error> {
    if value.is_undefined() {
        return Ok(Generator::value(Kind::Generator("do_items"), Vec::new()));
    }
    Generator::drain("do_items", &filters::items(value)?)
}

/// jinja2's `unique` (`sync_do_unique`).
fn unique(state: &State<'_, '_>, value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    Generator::drain("sync_do_unique", &filters::unique(state, value, kwargs)?)
}

/// jinja2's `batch` (`do_batch`).
fn batch(
    state: &State<'_, '_>,
    value: Value,
    count: usize,
    fill_with: Option<Value>,
) -> Result<Value, Error> {
    Generator::drain("do_batch", &filters::batch(state, value, count, fill_with)?)
}

/// jinja2's `slice` (`sync_do_slice`).
fn slice(
    state: &State<'_, '_>,
    value: Value,
    count: usize,
    fill_with: Option<Value>,
) -> Result<Value, Error> {
    Generator::drain(
        "sync_do_slice",
        &filters::slice(state, value, count, fill_with)?,
    )
}

/// jinja2's `reverse`: a string reversed; a list's or a dict's Python
/// `reversed()` iterator (a dict's yields its keys); a generator read
/// into a list and reversed (minijinja's `reverse`, which reads an
/// iterable it cannot reverse); an undefined value an empty `reversed`
/// object; `none` refused.
fn reverse(value: Value) -> Result<Value, Error> {
    let reversed = |name, value: &Value| -> Result<Value, Error> {
        let mut items: Vec<Value> = value.try_iter()?.collect();
        items.reverse();
        Ok(Generator::value(Kind::Iterator(name), items))
    };
    match value.kind() {
        ValueKind::Seq => reversed("list_reverseiterator", &value),
        ValueKind::Map => reversed("dict_reversekeyiterator", &value),
        // Undefined has a length (0) and an index, so Python's
        // `reversed()` takes it as a sequence.
        ValueKind::Undefined => Ok(Generator::value(Kind::Iterator("reversed"), Vec::new())),
        ValueKind::None => Err(Error::new(
            ErrorKind::InvalidOperation,
            "reverse: argument must be iterable",
        )),
        _ => filters::reverse(&value),
    }
}

/// jinja2's `last`, which takes `next(reversed(value))`: a generator is
/// not reversible, so it raises; anything else is minijinja's `last`.
fn last(value: Value) -> Result<Value, Error> {
    if let Some(name) = python_type(&value) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("last: '{name}' object is not reversible"),
        ));
    }
    filters::last(value)
}
