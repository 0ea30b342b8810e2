//! The evaluator: one rendering of a compiled template.

use std::fmt::Write as _;
use std::hash::Hasher as _;
use std::rc::Rc;

use minijinja::value::{Value, ValueKind};

use super::memo::{Entry, Memo, Point, Stored, encode, key_hasher};

/// A run of the request's messages encoded for the memo's key (module
/// `memo`), kept for the rendering's next memoized loop over the same
/// items (templates that loop over the messages twice: a check, then the
/// rendering).
pub(super) struct Encoded<'a> {
    list: &'a [Value],
    /// The canonical encoding, and its length after each item.
    items: Vec<u8>,
    bounds: Vec<usize>,
    /// The hasher after each item (the loop and the cap are added last).
    hashers: Vec<ahash::AHasher>,
}
use super::tree::{Arith, Cmp, Expr, FilterKind, ForLoop, LoopAttr, Method, Side, Stmt, TestKind};
use super::value::{Chain, MERGE_MAX_DEPTH, V, compare, int, vec_items};
use super::{DirectTemplate, MAX_MACRO_DEPTH, Name, Step, declined};
use crate::clock_text::strftime_cached;
use crate::request::{small_map_entries, small_map_get};
use crate::tojson::json_text;

/// A `+` chain's value so far, left to right.
enum Sum {
    Empty,
    Text(String),
    Int(i64),
    /// Strings written straight to the output (a chain `{{ }}` prints).
    Written,
    /// Sequences joined: the items so far, and the depth minijinja counts
    /// for the concatenation (0: a plain sequence).
    List(Vec<Value>, usize),
}

/// The most items a `+` of sequences makes here: each `+` copies them,
/// so longer concatenations are left to minijinja.
const MAX_CHAIN_ITEMS: usize = 4096;

pub(super) struct LoopState<'a> {
    index: usize,
    len: usize,
    /// The borrowed items of a loop over a sequence, for `previtem` and
    /// `nextitem` (`None` for other loops: those decline).
    items: Option<&'a [Value]>,
    reversed: bool,
}

/// How the statements of a loop body end: on their own, or at a `break`
/// or `continue` that the enclosing loop takes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Flow {
    Next,
    Break,
    Continue,
}

pub(super) struct Run<'a> {
    pub(super) template: &'a DirectTemplate,
    pub(super) globals: Vec<Option<&'a Value>>,
    pub(super) vars: Vec<(Name, V<'a>)>,
    /// Lookups in `vars` stop here: the start of the running macro's frame.
    pub(super) barrier: usize,
    /// How many of the top level's macros are defined so far (they are
    /// defined in order): a call of a later one declines (minijinja has
    /// no such name yet).
    pub(super) macros_defined: usize,
    /// While a loop or a macro runs: the length of `vars` when the
    /// outermost one began, the end of the top level's frame (what a
    /// macro's closure reads).
    pub(super) top_end: usize,
    pub(super) loops: Vec<LoopState<'a>>,
    /// Set by `break` / `continue` until their loop takes it.
    pub(super) flow: Flow,
    pub(super) namespaces: Vec<Vec<(&'a str, V<'a>)>>,
    pub(super) out: String,
    pub(super) max_output: usize,
    pub(super) steps_left: u64,
    pub(super) depth: usize,
    pub(super) clock_seconds: &'a dyn Fn() -> i64,
    /// The construct of the `Decline` node that ended the rendering, if
    /// one did (for diagnostics).
    pub(super) declined_at: Option<&'a str>,
    /// The template's render memo, if it has one.
    pub(super) memo: Option<&'a Memo>,
    /// The items of the context's `messages`: a top-level loop over them
    /// (or a slice of them) is the one the memo resumes.
    pub(super) messages: Option<&'a [Value]>,
    /// What the memoized loop's iterations read, while one runs.
    pub(super) rec: Option<Recording>,
    /// How many captures (`set` blocks, macro calls as values) are open:
    /// a loop inside one is not memoized.
    pub(super) capturing: usize,
    /// The last memoized loop's items, encoded.
    pub(super) encoded: Option<Encoded<'a>>,
}

/// An operand of `+` that minijinja concatenates as a sequence (a plain
/// list, a slice, a chain): its items and its concatenation depth.
fn sequence_operand<'v>(v: &'v V<'_>) -> Option<(&'v [Value], usize)> {
    match v {
        V::Chain(chain) => Some((&chain.items, chain.depth)),
        V::Slice(list) => Some((list, 0)),
        V::Ref(_) | V::Own(_) => v.items().map(|items| (items, 0)),
        V::Ns(_) => None,
    }
}

/// The key/value pairs of the mapping `map` in the order minijinja's
/// `dictsort` filter (no arguments) gives them, computed by that filter.
fn dictsort_pairs(map: &Value) -> Step<Vec<(Value, Value)>> {
    let no_arguments = minijinja::value::Kwargs::from_iter(std::iter::empty::<(&str, Value)>());
    let sorted = minijinja::filters::dictsort(map, no_arguments).map_err(|_| declined!())?;
    let pairs = sorted.try_iter().map_err(|_| declined!())?;
    pairs
        .map(|pair| {
            let key = pair.get_item(&Value::from(0)).map_err(|_| declined!())?;
            let value = pair.get_item(&Value::from(1)).map_err(|_| declined!())?;
            Ok((key, value))
        })
        .collect()
}

/// What the iterations of the memoized loop read from outside themselves
/// (module `memo`).
pub(super) struct Recording {
    /// `loops.len()` while the memoized loop is the innermost.
    depth: usize,
    /// `vars.len()` at the loop's start: a name found below it is read
    /// from outside the iterations.
    mark: usize,
    /// The names read from outside (variables below `mark`, context
    /// values, names bound to nothing), each once.
    reads: Vec<Name>,
    /// Set when an iteration read what the memo cannot key on
    /// (`loop.length`, `loop.revindex`, the clock): nothing is stored.
    spoiled: bool,
}

/// One rendering's use of the memo for one loop: the items' key, and the
/// states to store when the loop ends.
struct Session<'a> {
    memo: &'a Memo,
    loop_id: usize,
    /// The items' canonical encoding.
    enc: Encoded<'a>,
    /// The key's hash through each item.
    hashes: Vec<u64>,
    /// `out.len()` at the loop's start.
    pre_len: usize,
    steps_start: u64,
    /// The namespaces as they were at the loop's start.
    ns_start: Vec<Vec<(&'a str, V<'a>)>>,
    mark: usize,
    points: Vec<Point>,
    reads: Vec<(Name, Box<[u8]>)>,
}

impl<'a> Run<'a> {
    fn step(&mut self) -> Step<()> {
        self.steps_left = self.steps_left.checked_sub(1).ok_or(declined!())?;
        Ok(())
    }

    fn write(&mut self, text: &str) -> Step<()> {
        if self.out.len().saturating_add(text.len()) > self.max_output {
            return Err(declined!());
        }
        self.out.push_str(text);
        Ok(())
    }

    pub(super) fn exec(&mut self, stmts: &'a [Stmt]) -> Step<()> {
        for stmt in stmts {
            if self.flow != Flow::Next {
                // A `break` or `continue` below: skip to the loop.
                return Ok(());
            }
            self.step()?;
            match stmt {
                Stmt::Raw(text) => self.write(text)?,
                Stmt::Emit(e) => self.emit(e)?,
                Stmt::If(cond, then, otherwise) => {
                    if self.test(cond)? {
                        self.exec(then)?;
                    } else {
                        self.exec(otherwise)?;
                    }
                }
                Stmt::For(f) => self.for_loop(f)?,
                Stmt::Set(name, e) => {
                    let value = self.eval(e)?;
                    self.vars.push((*name, value));
                }
                Stmt::SetAttr {
                    name,
                    from_closure,
                    attr,
                    value,
                } => {
                    let base = if *from_closure {
                        self.closure(*name)
                    } else {
                        self.lookup(*name)
                    };
                    let V::Ns(ns) = base else {
                        return Err(declined!());
                    };
                    let value = self.eval(value)?;
                    let fields = &mut self.namespaces[ns];
                    match fields.iter_mut().find(|(k, _)| *k == &**attr) {
                        Some(slot) => slot.1 = value,
                        None => fields.push((attr, value)),
                    }
                }
                Stmt::SetBlock(name, body) => {
                    let outer = std::mem::take(&mut self.out);
                    self.capturing += 1;
                    let done = self.exec(body);
                    self.capturing -= 1;
                    let text = std::mem::replace(&mut self.out, outer);
                    done?;
                    // No auto-escaping: minijinja captures a plain string.
                    self.vars.push((*name, V::Own(Value::from(text))));
                }
                Stmt::DefineMacro => self.macros_defined += 1,
                Stmt::Break => self.flow = Flow::Break,
                Stmt::Continue => self.flow = Flow::Continue,
                Stmt::Decline(what) => {
                    self.declined_at = Some(what);
                    return Err(declined!());
                }
            }
        }
        Ok(())
    }

    fn for_loop(&mut self, f: &'a ForLoop) -> Step<()> {
        if let Some(args) = &f.range {
            return self.for_range(f, args);
        }
        let seq = self.eval(&f.iter)?;
        if f.value_target.is_some() {
            return self.for_pairs(f, f.value_target, seq);
        }
        // A mapping (one of the request's objects) iterates its keys.
        if let Ok(value) = seq.value()
            && small_map_entries(value).is_some()
        {
            return self.for_pairs(f, None, seq);
        }
        let borrowed = seq.borrowed_items();
        let len = match seq.items() {
            Some(list) => list.len(),
            None if seq.value()?.is_undefined() => 0,
            None => return Err(declined!()),
        };
        let memo_items = borrowed.filter(|list| !f.reversed && self.resumable(list));
        self.iterate(f, len, borrowed, f.reversed, memo_items, |run, index| {
            let at = if f.reversed { len - 1 - index } else { index };
            let item = match borrowed {
                Some(list) => V::Ref(&list[at]),
                None => V::Own(seq.items().ok_or(declined!())?[at].clone()),
            };
            run.vars.push((f.target, item));
            Ok(())
        })
    }

    /// The iterations of a loop of `len` items, as minijinja runs them:
    /// `bind` pushes the loop variables of the `index`th item (in the
    /// order the loop reads), the filter (if any) skips an item, the
    /// body runs with `loop.*` set, `break` and `continue` end an
    /// iteration, and `else` runs when no item past the first was
    /// fetched. `items` are the borrowed items for `loop.previtem` and
    /// `loop.nextitem` (`None`: those decline). One copy for every kind
    /// of loop, so the kinds cannot drift apart.
    fn iterate(
        &mut self,
        f: &'a ForLoop,
        len: usize,
        items: Option<&'a [Value]>,
        reversed: bool,
        memo_items: Option<&'a [Value]>,
        mut bind: impl FnMut(&mut Self, usize) -> Step<()>,
    ) -> Step<()> {
        if self.at_top() {
            self.top_end = self.vars.len();
        }
        self.loops.push(LoopState {
            index: 0,
            len,
            items,
            reversed,
        });
        let (mut ran, mut broke) = (0usize, false);
        let mut start = 0;
        let mut session = None;
        if let Some(list) = memo_items {
            session = self.memo_begin(f, list, &mut start, &mut ran)?;
        }
        for index in start..len {
            // The states stored: after all items but the last, and but
            // the last two (a conversation's next request repeats them
            // all, a retried or edited last message all but it).
            if let Some(session) = &mut session
                && index > start
                && index + 2 >= len
            {
                self.memo_point(session, index, ran);
            }
            self.step()?;
            let mark = self.vars.len();
            bind(self, index)?;
            if let Some(filter) = &f.filter {
                // minijinja runs a filtered loop's items twice: once to
                // filter, once for the body.
                self.step()?;
                if !self.test(filter)? {
                    self.vars.truncate(mark);
                    continue;
                }
            }
            ran += 1;
            if let Some(state) = self.loops.last_mut() {
                state.index = index;
            }
            self.exec(&f.body)?;
            self.vars.truncate(mark);
            if std::mem::replace(&mut self.flow, Flow::Next) == Flow::Break {
                broke = true;
                break;
            }
        }
        self.loops.pop();
        if let Some(session) = session {
            self.memo_end(session);
        }
        // minijinja runs `else` when its loop fetched no item past the
        // first: none at all, or a `break` in the first iteration; it
        // runs it in the enclosing scope, so its `set`s stay.
        if ran == 0 || (broke && ran == 1) {
            self.exec(&f.else_body)?;
        }
        Ok(())
    }

    /// `for i in range(...)`: minijinja's `range` (`range(upper)`,
    /// `range(lower, upper[, step])`, at most 100,000 items) of integers.
    fn for_range(&mut self, f: &'a ForLoop, args: &'a [Expr]) -> Step<()> {
        let mut ints = [0i64; 3];
        for (slot, arg) in ints.iter_mut().zip(args) {
            let v = self.eval(arg)?;
            *slot = int(v.value()?).ok_or(declined!())?;
        }
        let (lower, upper, step) = match args.len() {
            1 => (0, ints[0], 1),
            2 => (ints[0], ints[1], 1),
            _ => (ints[0], ints[1], ints[2]),
        };
        // The count as minijinja's iterators give it; zero steps and
        // oversized ranges are its errors.
        let len = if step > 0 && upper > lower {
            (i128::from(upper) - i128::from(lower) + i128::from(step) - 1) / i128::from(step)
        } else if step < 0 && lower > upper {
            (i128::from(lower) - i128::from(upper) - i128::from(step) - 1) / -i128::from(step)
        } else if step == 0 {
            return Err(declined!());
        } else {
            0
        };
        if len > 100_000 {
            return Err(declined!());
        }
        let len = len as usize;
        self.iterate(f, len, None, false, None, |run, index| {
            let value = lower
                .checked_add((index as i64).checked_mul(step).ok_or(declined!())?)
                .ok_or(declined!())?;
            run.vars.push((f.target, V::Own(Value::from(value))));
            Ok(())
        })
    }

    /// `for k, v in map.items()` over one of the request's objects: its
    /// pairs in order, as pycompat's `items()` and the `items` filter
    /// yield them; without `value_target`, `for k in map`: its keys. Any
    /// other value (undefined, a dict from the context, a namespace) is
    /// minijinja's.
    fn for_pairs(&mut self, f: &'a ForLoop, value_target: Option<Name>, map: V<'a>) -> Step<()> {
        if f.sorted
            && let Ok(value) = map.value()
            && value.kind() == ValueKind::Map
            && small_map_entries(value).is_none()
        {
            // Any other mapping (a dict literal, one from the context):
            // its pairs as minijinja's own `dictsort` sorts them.
            let pairs = dictsort_pairs(value)?;
            return self.iterate(f, pairs.len(), None, false, None, |run, index| {
                let (key, value) = pairs.get(index).ok_or(declined!())?;
                run.vars.push((f.target, V::Own(key.clone())));
                if let Some(value_target) = value_target {
                    run.vars.push((value_target, V::Own(value.clone())));
                }
                Ok(())
            });
        }
        let (mut borrowed, mut owned) = match map {
            V::Ref(value) => (Some(small_map_entries(value).ok_or(declined!())?), None),
            V::Own(value) => (
                None,
                Some(small_map_entries(&value).ok_or(declined!())?.to_vec()),
            ),
            V::Ns(_) | V::Slice(_) | V::Chain(_) => return Err(declined!()),
        };
        if f.sorted {
            // minijinja's `dictsort`: a stable sort on the keys compared
            // case-insensitively (ASCII, its `unicode` feature being off);
            // only string keys are taken here.
            let mut pairs = match (borrowed, owned) {
                (Some(pairs), _) => pairs.to_vec(),
                (None, Some(pairs)) => pairs,
                (None, None) => return Err(declined!()),
            };
            if pairs.iter().any(|(k, _)| k.kind() != ValueKind::String) {
                return Err(declined!());
            }
            pairs.sort_by_cached_key(|(k, _)| k.as_str().unwrap_or_default().to_ascii_lowercase());
            borrowed = None;
            owned = Some(pairs);
        }
        let len = borrowed.map_or_else(|| owned.as_ref().map_or(0, Vec::len), <[_]>::len);
        self.iterate(f, len, None, false, None, |run, index| {
            let (key, value) = match (borrowed, &owned) {
                (Some(pairs), _) => (V::Ref(&pairs[index].0), V::Ref(&pairs[index].1)),
                (None, Some(pairs)) => (
                    V::Own(pairs[index].0.clone()),
                    V::Own(pairs[index].1.clone()),
                ),
                (None, None) => return Err(declined!()),
            };
            run.vars.push((f.target, key));
            if let Some(value_target) = value_target {
                run.vars.push((value_target, value));
            }
            Ok(())
        })
    }

    /// Whether a loop over `list` is one the memo resumes: the template
    /// has a memo, the loop is at the top level (no macro, loop or
    /// capture around it), and `list` is the request's messages or a
    /// slice of them, two or more.
    fn resumable(&self, list: &[Value]) -> bool {
        self.memo.is_some()
            && self.rec.is_none()
            && self.depth == 0
            && self.loops.is_empty()
            && self.capturing == 0
            && list.len() >= 2
            && self.is_messages(list)
    }

    /// Whether `list` lies within the request's messages.
    fn is_messages(&self, list: &[Value]) -> bool {
        self.messages.is_some_and(|all| {
            let range = all.as_ptr_range();
            let inner = list.as_ptr_range();
            range.start <= inner.start && inner.end <= range.end && !list.is_empty()
        })
    }

    /// Starts the memo's session for the loop `f` over `list`: the items'
    /// key, and, when a stored state matches, the rendering resumed from
    /// it (`start` and `ran` set to its iteration and count). `None`
    /// when an item cannot be keyed.
    fn memo_begin(
        &mut self,
        f: &'a ForLoop,
        list: &'a [Value],
        start: &mut usize,
        ran: &mut usize,
    ) -> Step<Option<Session<'a>>> {
        let Some(memo) = self.memo else {
            return Ok(None);
        };
        let loop_id = std::ptr::from_ref(f) as usize;
        let enc = match self.encoded.take() {
            Some(enc) if std::ptr::eq(enc.list, list) => enc,
            _ => {
                let mut enc = Encoded {
                    list,
                    items: Vec::with_capacity(list.len() * 160),
                    bounds: Vec::with_capacity(list.len()),
                    hashers: Vec::with_capacity(list.len()),
                };
                let mut hasher = key_hasher();
                for item in list {
                    let from = enc.items.len();
                    if !encode(&mut enc.items, item) {
                        return Ok(None);
                    }
                    hasher.write(&enc.items[from..]);
                    enc.bounds.push(enc.items.len());
                    enc.hashers.push(hasher.clone());
                }
                enc
            }
        };
        let hashes = enc
            .hashers
            .iter()
            .map(|hasher| {
                let mut hasher = hasher.clone();
                hasher.write_usize(loop_id);
                hasher.write_usize(self.max_output);
                hasher.finish()
            })
            .collect();
        let mut session = Session {
            memo,
            loop_id,
            enc,
            hashes,
            pre_len: self.out.len(),
            steps_start: self.steps_left,
            ns_start: self.namespaces.clone(),
            mark: self.vars.len(),
            points: Vec::new(),
            reads: Vec::new(),
        };
        let mut reads = Vec::new();
        // The longest stored prefix first; a state is used only for
        // `k` below the item count (module docs: `loop.last`).
        for k in (1..list.len()).rev() {
            let Some(entry) = memo.get(session.hashes[k]) else {
                continue;
            };
            let Some((point, namespaces)) = self.memo_match(&session, &entry, k) else {
                continue;
            };
            let text = &entry.text[..point.text_len];
            if self.out.len().saturating_add(text.len()) > self.max_output {
                return Err(declined!());
            }
            self.steps_left = self
                .steps_left
                .checked_sub(point.steps)
                .ok_or(declined!())?;
            self.out.push_str(text);
            for (at, fields) in namespaces {
                if at < self.namespaces.len() {
                    self.namespaces[at] = fields;
                } else {
                    self.namespaces.push(fields);
                }
            }
            *start = k;
            *ran = point.ran;
            reads = entry.reads.iter().map(|(name, _)| *name).collect();
            session.reads = entry.reads.clone();
            break;
        }
        memo.count(*start > 0);
        self.rec = Some(Recording {
            depth: self.loops.len(),
            mark: session.mark,
            reads,
            spoiled: false,
        });
        Ok(Some(session))
    }

    /// The stored state of `entry` after `k` iterations, with its
    /// namespaces ready to install, when it applies to this rendering:
    /// the same loop, output cap and namespace count, items `0..=k`
    /// equal byte for byte, and every name the iterations read encoding
    /// as it did.
    #[allow(clippy::type_complexity)] // reason: a private pair, read at one call
    fn memo_match<'e>(
        &self,
        session: &Session<'a>,
        entry: &'e Entry,
        k: usize,
    ) -> Option<(&'e Point, Vec<(usize, Vec<(&'a str, V<'a>)>)>)> {
        if entry.loop_id != session.loop_id
            || entry.max_output != self.max_output
            || entry.ns_count != session.ns_start.len()
        {
            return None;
        }
        let point = entry.points.iter().find(|p| p.k == k)?;
        if point.items_len != session.enc.bounds[k]
            || entry.items.get(..point.items_len)? != &session.enc.items[..point.items_len]
        {
            return None;
        }
        let mut buf = Vec::new();
        let mut reach = Vec::new();
        for (name, bytes) in &entry.reads {
            buf.clear();
            let value = self.outer(*name, session.mark);
            if !self.encode_v(&mut buf, &value, &session.ns_start, &mut reach, 0)
                || buf.as_slice() != &**bytes
            {
                return None;
            }
        }
        let mut namespaces = Vec::with_capacity(point.namespaces.len());
        let mut next_new = session.ns_start.len();
        for (at, fields) in &point.namespaces {
            if *at >= session.ns_start.len() {
                // Made by the iterations: appended in order.
                if *at != next_new {
                    return None;
                }
                next_new += 1;
            }
            let mut installed = Vec::with_capacity(fields.len());
            for (key, value) in fields {
                let key = self.template.ns_fields.iter().find(|f| ***f == **key)?;
                installed.push((
                    &**key,
                    match value {
                        Stored::Value(v) => V::Own(v.clone()),
                        Stored::Ns(i) => V::Ns(*i),
                    },
                ));
            }
            namespaces.push((*at, installed));
        }
        Some((point, namespaces))
    }

    /// Appends the canonical encoding of `v` (module `memo`), a namespace
    /// as it was at the loop's start (`ns_start`), noting the namespaces
    /// it reaches in `reach`. `false` for what cannot be encoded: the
    /// request's messages list or a slice of it (its later items are not
    /// in the key), or a value of another kind.
    fn encode_v(
        &self,
        buf: &mut Vec<u8>,
        v: &V<'a>,
        ns_start: &[Vec<(&'a str, V<'a>)>],
        reach: &mut Vec<usize>,
        depth: usize,
    ) -> bool {
        if depth > 8 {
            return false;
        }
        match v {
            V::Ref(value) => self.encode_plain(buf, value),
            V::Own(value) => self.encode_plain(buf, value),
            V::Chain(chain) => {
                // Its items and its depth (which decides when a later `+`
                // makes a list) are all it is.
                buf.push(12);
                buf.extend_from_slice(&(chain.depth as u64).to_le_bytes());
                buf.extend_from_slice(&(chain.items.len() as u64).to_le_bytes());
                chain.items.iter().all(|item| encode(buf, item))
            }
            V::Slice(list) => {
                if self.is_messages(list) {
                    return false;
                }
                buf.push(10);
                buf.extend_from_slice(&(list.len() as u64).to_le_bytes());
                list.iter().all(|item| encode(buf, item))
            }
            V::Ns(at) => {
                let Some(fields) = ns_start.get(*at) else {
                    return false;
                };
                buf.push(11);
                buf.extend_from_slice(&(*at as u64).to_le_bytes());
                buf.extend_from_slice(&(fields.len() as u64).to_le_bytes());
                if !reach.contains(at) {
                    reach.push(*at);
                }
                for (key, value) in fields {
                    buf.extend_from_slice(&(key.len() as u64).to_le_bytes());
                    buf.extend_from_slice(key.as_bytes());
                    if !self.encode_v(buf, value, ns_start, reach, depth + 1) {
                        return false;
                    }
                }
                true
            }
        }
    }

    /// [`encode`], but `false` for the request's messages list.
    fn encode_plain(&self, buf: &mut Vec<u8>, value: &Value) -> bool {
        if vec_items(value).is_some_and(|list| self.is_messages(list)) {
            return false;
        }
        encode(buf, value)
    }

    /// Notes the state after the first `index` iterations, unless they
    /// read what the memo cannot key on.
    fn memo_point(&mut self, session: &mut Session<'a>, index: usize, ran: usize) {
        let Some(rec) = &self.rec else { return };
        if rec.spoiled {
            return;
        }
        let mut reads = Vec::with_capacity(rec.reads.len());
        let mut reach = Vec::new();
        let mut buf = Vec::new();
        for &name in &rec.reads {
            buf.clear();
            let value = self.outer(name, session.mark);
            if !self.encode_v(&mut buf, &value, &session.ns_start, &mut reach, 0) {
                if let Some(rec) = &mut self.rec {
                    rec.spoiled = true;
                }
                return;
            }
            reads.push((name, buf.as_slice().into()));
        }
        // The namespaces the iterations can have changed: those reached
        // from what they read, and those they made.
        reach.retain(|&at| at < session.ns_start.len());
        reach.sort_unstable();
        reach.extend(session.ns_start.len()..self.namespaces.len());
        let mut namespaces = Vec::with_capacity(reach.len());
        for at in reach {
            let mut fields = Vec::new();
            for (key, value) in &self.namespaces[at] {
                let stored = match value {
                    V::Ns(i) => Stored::Ns(*i),
                    V::Ref(v) if scalar(v) => Stored::Value((*v).clone()),
                    V::Own(v) if scalar(v) => Stored::Value(v.clone()),
                    // Sequences and maps keep borrowed items; not stored.
                    _ => return,
                };
                fields.push(((*key).into(), stored));
            }
            namespaces.push((at, fields));
        }
        session.reads = reads;
        session.points.push(Point {
            k: index,
            items_len: session.enc.bounds[index],
            text_len: self.out.len() - session.pre_len,
            steps: session.steps_start - self.steps_left,
            ran,
            namespaces,
        });
    }

    /// Ends the memoized loop: stores the states it noted.
    fn memo_end(&mut self, session: Session<'a>) {
        self.rec = None;
        let Session {
            memo,
            loop_id,
            enc,
            hashes,
            pre_len,
            ns_start,
            points,
            reads,
            ..
        } = session;
        if let Some(&Point {
            items_len,
            text_len,
            ..
        }) = points.last()
            && let Some(text) = self.out.get(pre_len..pre_len + text_len)
        {
            let keys: Vec<u64> = points.iter().map(|p| hashes[p.k]).collect();
            let entry = Entry::new(
                loop_id,
                self.max_output,
                enc.items[..items_len].into(),
                text.into(),
                reads,
                ns_start.len(),
                points,
            );
            memo.insert(&keys, entry);
        }
        self.encoded = Some(enc);
    }

    /// Whether `v` is true as minijinja's `if` decides.
    fn truthy(&self, v: &V<'a>) -> Step<bool> {
        match v {
            V::Ref(value) => Ok(value.is_true()),
            V::Own(value) => Ok(value.is_true()),
            // A namespace is a map: true once it has a field.
            V::Ns(ns) => Ok(!self.namespaces[*ns].is_empty()),
            // minijinja's slice is a lazy iterable; left to it.
            V::Slice(_) => Err(declined!()),
            // Its `+` of sequences knows its length: true when not empty.
            V::Chain(chain) => Ok(!chain.items.is_empty()),
        }
    }

    /// Evaluates `e` and decides whether it is true.
    fn test(&mut self, e: &'a Expr) -> Step<bool> {
        let v = self.eval(e)?;
        self.truthy(&v)
    }

    fn lookup(&mut self, name: Name) -> V<'a> {
        let frame = &self.vars[self.barrier..];
        if let Some(at) = frame.iter().rposition(|(n, _)| *n == name) {
            if let Some(rec) = &mut self.rec
                && self.barrier + at < rec.mark
            {
                rec.read(name);
            }
            return frame[at].1.clone();
        }
        if let Some(rec) = &mut self.rec {
            rec.read(name);
        }
        match self.globals[usize::from(name)] {
            Some(value) => V::Ref(value),
            None => V::undefined(),
        }
    }

    /// `name` as a macro reads it from its closure: the top level's
    /// current binding, else the context's value. minijinja's closure
    /// holds the value the name had when the macro was defined (the top
    /// level's or the context's) and takes every later store of the top
    /// level's frame; loops and macros store in frames of their own.
    fn closure(&mut self, name: Name) -> V<'a> {
        if let Some(rec) = &mut self.rec {
            // Read from outside the memoized loop's iterations, which
            // run at the top level: its mark is the top level's end.
            rec.read(name);
        }
        self.outer(name, self.top_len())
    }

    /// How many of `vars` are the top level's frame: all of them at the
    /// top level, else those before the outermost loop or macro began.
    fn top_len(&self) -> usize {
        if self.at_top() {
            self.vars.len()
        } else {
            self.top_end.min(self.vars.len())
        }
    }

    /// Whether the running statement is in the top level's frame (no
    /// loop or macro around it).
    fn at_top(&self) -> bool {
        self.depth == 0 && self.loops.is_empty()
    }

    /// `name`'s value as the memoized loop's iterations find it outside
    /// themselves: below `mark` (the top level's frame), else the context.
    fn outer(&self, name: Name, mark: usize) -> V<'a> {
        if let Some((_, value)) = self.vars[..mark].iter().rev().find(|(n, _)| *n == name) {
            return value.clone();
        }
        match self.globals[usize::from(name)] {
            Some(value) => V::Ref(value),
            None => V::undefined(),
        }
    }

    /// Writes `e`'s value as `{{ e }}` prints it; conditionals and macro
    /// calls are written piece by piece, as they print the same. A `~`
    /// chain is joined first: its pieces are strings as `~` makes them
    /// (`Display`), which is not how `{{ }}` prints a non-string.
    fn emit(&mut self, e: &'a Expr) -> Step<()> {
        match e {
            Expr::Concat(..) => {
                let mut text = String::new();
                self.append(&mut text, e)?;
                self.write(&text)
            }
            Expr::Cond(test, yes, no) => {
                self.step()?;
                if self.test(test)? {
                    self.emit(yes)
                } else if let Some(no) = no {
                    self.emit(no)
                } else {
                    Ok(())
                }
            }
            Expr::CallMacro(index, args) => self.call_macro(*index, args),
            Expr::Add(..) => {
                let mut sum = Sum::Empty;
                self.add(&mut sum, e, true)?;
                match sum {
                    Sum::Int(n) => self.print(&Value::from(n)),
                    Sum::Written => Ok(()),
                    Sum::Empty | Sum::Text(_) | Sum::List(..) => Err(declined!()),
                }
            }
            Expr::Text(_, text) => {
                self.step()?;
                self.write(text)
            }
            other => {
                let value = self.eval(other)?;
                self.print(value.value()?)
            }
        }
    }

    /// Prints a value as the template's formatter does with no
    /// auto-escaping: a string as it is, None, booleans, numbers, lists
    /// and dicts as Python's `str()` (module `pyrepr`), anything else
    /// through the value's `Display`.
    fn print(&mut self, value: &Value) -> Step<()> {
        if let Some(text) = value.as_str() {
            return self.write(text);
        }
        if let Some(text) = crate::pyrepr::python_str(value) {
            return self.write(&text);
        }
        let _ = write!(self.out, "{value}");
        if self.out.len() > self.max_output {
            return Err(declined!());
        }
        Ok(())
    }

    fn call_macro(&mut self, index: usize, args: &'a [(usize, Expr)]) -> Step<()> {
        self.step()?;
        if index >= self.macros_defined {
            return Err(declined!());
        }
        let def = self.template.macros.get(index).ok_or(declined!())?;
        if self.depth >= MAX_MACRO_DEPTH {
            return Err(declined!());
        }
        // Evaluated in the call's order, each into its parameter's slot
        // (the rest undefined, as minijinja leaves them).
        let mut values = vec![V::undefined(); def.params.len()];
        for (slot, arg) in args {
            let value = self.eval(arg)?;
            *values.get_mut(*slot).ok_or(declined!())? = value;
        }
        let mark = self.vars.len();
        if self.at_top() {
            self.top_end = mark;
        }
        let outer_barrier = std::mem::replace(&mut self.barrier, mark);
        let mut values = values.into_iter();
        for (&param, default) in def.params.iter().zip(&def.defaults) {
            // minijinja spends an instruction binding each parameter.
            self.step()?;
            let mut value = values.next().unwrap_or_else(V::undefined);
            if let Some(default) = default
                && value.value().is_ok_and(Value::is_undefined)
            {
                value = V::Ref(default);
            }
            self.vars.push((param, value));
        }
        self.depth += 1;
        let done = self.exec(&def.body);
        self.depth -= 1;
        self.vars.truncate(mark);
        self.barrier = outer_barrier;
        done
    }

    fn capture_macro(&mut self, index: usize, args: &'a [(usize, Expr)]) -> Step<V<'a>> {
        let outer = std::mem::take(&mut self.out);
        self.capturing += 1;
        let done = self.call_macro(index, args);
        self.capturing -= 1;
        let text = std::mem::replace(&mut self.out, outer);
        done?;
        Ok(V::Own(Value::from(text)))
    }

    fn eval(&mut self, e: &'a Expr) -> Step<V<'a>> {
        self.step()?;
        Ok(match e {
            Expr::Const(value) | Expr::Text(value, _) => V::Ref(value),
            Expr::Var(name) => self.lookup(*name),
            Expr::Closure(name) => self.closure(*name),
            Expr::Loop(attr) => {
                if let Some(rec) = &mut self.rec
                    && self.loops.len() == rec.depth
                    && matches!(
                        attr,
                        LoopAttr::Length | LoopAttr::RevIndex | LoopAttr::RevIndex0
                    )
                {
                    // Every iteration's value depends on the item count.
                    rec.spoiled = true;
                }
                let state = self.loops.last().ok_or(declined!())?;
                let (i, n) = (state.index as i64, state.len as i64);
                match attr {
                    LoopAttr::Index0 => V::Own(Value::from(i)),
                    LoopAttr::Index => V::Own(Value::from(i + 1)),
                    LoopAttr::RevIndex0 => V::Own(Value::from(n - i - 1)),
                    LoopAttr::RevIndex => V::Own(Value::from(n - i)),
                    LoopAttr::First => V::bool(i == 0),
                    LoopAttr::Last => V::bool(i + 1 == n),
                    LoopAttr::Length => V::Own(Value::from(n)),
                    LoopAttr::PrevItem | LoopAttr::NextItem => {
                        let items = state.items.ok_or(declined!())?;
                        // The neighbour in the order the loop reads.
                        let step = if matches!(attr, LoopAttr::PrevItem) {
                            -1
                        } else {
                            1
                        };
                        let next = i + step;
                        if next < 0 || next >= n {
                            V::undefined()
                        } else {
                            let at = if state.reversed { n - 1 - next } else { next };
                            V::Ref(&items[at as usize])
                        }
                    }
                }
            }
            Expr::Attr(base, name) => {
                let base = self.eval(base)?;
                self.attr(base, name)?
            }
            Expr::Item(base, key) => {
                let base = self.eval(base)?;
                let key = self.eval(key)?;
                self.item(base, key.value()?)?
            }
            Expr::Slice(base, start, stop) => {
                let base = self.eval(base)?;
                if let Ok(text) = base.value()
                    && text.kind() == ValueKind::String
                {
                    return self.slice_text(text.as_str().ok_or(declined!())?, start, stop);
                }
                let len = base.items().ok_or(declined!())?.len() as i64;
                let bound = |this: &mut Self, e: &'a Option<Box<Expr>>, default: i64| {
                    let Some(e) = e else { return Ok(default) };
                    let v = this.eval(e)?;
                    let v = v.value()?;
                    if v.is_none() {
                        return Ok(default);
                    }
                    let i = int(v).ok_or(declined!())?;
                    Ok(if i < 0 { (len + i).max(0) } else { i.min(len) })
                };
                let from = bound(self, start, 0)?;
                let to = bound(self, stop, len)?.max(from);
                let range = from as usize..to as usize;
                // minijinja's slice is a lazy iterable (not a sequence to
                // `is sequence`): modelled only as a view of borrowed items.
                V::Slice(&base.borrowed_items().ok_or(declined!())?[range])
            }
            Expr::Not(inner) => V::bool(!self.test(inner)?),
            Expr::Neg(inner) => {
                let v = self.eval(inner)?;
                let n = int(v.value()?).ok_or(declined!())?;
                V::Own(Value::from(n.checked_neg().ok_or(declined!())?))
            }
            Expr::Concat(left, right) => {
                let mut text = String::new();
                self.append(&mut text, left)?;
                self.append(&mut text, right)?;
                V::Own(Value::from(text))
            }
            Expr::And(left, right) => {
                let l = self.eval(left)?;
                if self.truthy(&l)? {
                    self.eval(right)?
                } else {
                    l
                }
            }
            Expr::Or(left, right) => {
                let l = self.eval(left)?;
                if self.truthy(&l)? {
                    l
                } else {
                    self.eval(right)?
                }
            }
            Expr::Compare(left, op, right) => {
                let l = self.eval(left)?;
                let r = self.eval(right)?;
                let l = l.value()?;
                V::bool(match (op, r.items()) {
                    (Cmp::In, Some(list)) => list.iter().any(|x| x == l),
                    (Cmp::NotIn, Some(list)) => !list.iter().any(|x| x == l),
                    _ => compare(l, *op, r.value()?)?,
                })
            }
            Expr::Cond(test, yes, no) => {
                if self.test(test)? {
                    self.eval(yes)?
                } else if let Some(no) = no {
                    self.eval(no)?
                } else {
                    V::undefined()
                }
            }
            Expr::Test(kind, inner) => {
                let v = self.eval(inner)?;
                if let V::Slice(_) | V::Chain(_) = v {
                    // An iterable: defined, and no sequence.
                    return Ok(V::bool(matches!(
                        kind,
                        TestKind::Defined | TestKind::Iterable
                    )));
                }
                let v = v.value()?;
                V::bool(match kind {
                    TestKind::Defined => !v.is_undefined(),
                    TestKind::Undefined => v.is_undefined(),
                    TestKind::None => v.is_none(),
                    TestKind::String => v.kind() == ValueKind::String,
                    TestKind::Sequence => v.kind() == ValueKind::Seq,
                    TestKind::Mapping => v.kind() == ValueKind::Map,
                    TestKind::Number => v.kind() == ValueKind::Number,
                    TestKind::Boolean => v.kind() == ValueKind::Bool,
                    TestKind::Iterable => crate::pyfilters::is_iterable(v),
                    TestKind::True => v.kind() == ValueKind::Bool && v.is_true(),
                    TestKind::False => v.kind() == ValueKind::Bool && !v.is_true(),
                })
            }
            Expr::Filter(kind, inner) => {
                let v = self.eval(inner)?;
                self.filter(kind, v)?
            }
            Expr::List(elements) => {
                let mut list = Vec::with_capacity(elements.len());
                for element in elements {
                    list.push(self.eval(element)?.value()?.clone());
                }
                V::Own(Value::from(list))
            }
            Expr::Map(pairs) => {
                // As minijinja's `BuildMap`: each key, then its value, in
                // the literal's order, into its own map (a repeated key
                // keeps its first place and takes the last value).
                let mut entries = Vec::with_capacity(pairs.len());
                for (key, value) in pairs {
                    let key = self.eval(key)?.value()?.clone();
                    let value = self.eval(value)?.value()?.clone();
                    entries.push((key, value));
                }
                V::Own(Value::from_iter(entries))
            }
            Expr::CallMacro(index, args) => self.capture_macro(*index, args)?,
            Expr::Namespace(fields) => {
                let mut values = Vec::with_capacity(fields.len());
                for (key, e) in fields {
                    let value = self.eval(e)?;
                    values.push((&**key, value));
                }
                self.namespaces.push(values);
                V::Ns(self.namespaces.len() - 1)
            }
            Expr::StrftimeNow(format) => {
                if let Some(rec) = &mut self.rec {
                    rec.spoiled = true;
                }
                let format = self.eval(format)?;
                let format = format.value()?.as_str().ok_or(declined!())?;
                V::Own(strftime_cached(format, (self.clock_seconds)()))
            }
            Expr::Method(base, Method::Get(key, default)) => {
                let base = self.eval(base)?;
                let key = self.eval(key)?;
                let key = key.value()?.as_str().ok_or(declined!())?;
                // pycompat's `get` on a mapping: the value, else the
                // default, else none.
                let found = match &base {
                    V::Ref(value) => small_map_get(value, key).ok_or(declined!())?.map(V::Ref),
                    V::Own(value) => small_map_get(value, key)
                        .ok_or(declined!())?
                        .map(|v| V::Own(v.clone())),
                    _ => return Err(declined!()),
                };
                match (found, default) {
                    (Some(v), _) => v,
                    (None, Some(default)) => self.eval(default)?,
                    (None, None) => V::Own(Value::from(())),
                }
            }
            Expr::Method(base, method) => {
                let base = self.eval(base)?;
                let text = base.value()?;
                if text.kind() != ValueKind::String {
                    return Err(declined!());
                }
                let text = text.as_str().ok_or(declined!())?;
                match method {
                    Method::Strip => V::Own(Value::from(text.trim())),
                    Method::LStrip => V::Own(Value::from(text.trim_start())),
                    Method::RStrip => V::Own(Value::from(text.trim_end())),
                    Method::StartsWith(arg) | Method::EndsWith(arg) => {
                        let arg = self.eval(arg)?;
                        let arg = arg.value()?;
                        if arg.kind() != ValueKind::String {
                            return Err(declined!());
                        }
                        let affix = arg.as_str().ok_or(declined!())?;
                        V::bool(if matches!(method, Method::StartsWith(_)) {
                            text.starts_with(affix)
                        } else {
                            text.ends_with(affix)
                        })
                    }
                    Method::StripChars(side, chars) => {
                        let chars = self.eval(chars)?;
                        let chars = chars.value()?;
                        if chars.kind() != ValueKind::String {
                            return Err(declined!());
                        }
                        let set: Vec<char> = chars.as_str().ok_or(declined!())?.chars().collect();
                        let set = set.as_slice();
                        V::Own(Value::from(match side {
                            Side::Both => text.trim_matches(set),
                            Side::Start => text.trim_start_matches(set),
                            Side::End => text.trim_end_matches(set),
                        }))
                    }
                    Method::Split(sep, max) => {
                        if base.value()?.is_safe() {
                            // minijinja keeps the pieces safe; left to it.
                            return Err(declined!());
                        }
                        let sep = match sep {
                            Some(sep) => {
                                let sep = self.eval(sep)?;
                                let sep = sep.value()?;
                                if sep.is_none() {
                                    None
                                } else if sep.kind() == ValueKind::String {
                                    Some(sep.as_str().ok_or(declined!())?.to_owned())
                                } else {
                                    return Err(declined!());
                                }
                            }
                            None => None,
                        };
                        let max = match max {
                            Some(max) => {
                                let max = self.eval(max)?;
                                Some(int(max.value()?).ok_or(declined!())?)
                            }
                            None => None,
                        };
                        // minijinja's `split`: a negative maxsplit is none,
                        // else at most maxsplit + 1 pieces.
                        let pieces = max.and_then(|n| usize::try_from(n).ok()?.checked_add(1));
                        let list: Vec<Value> = match (&sep, pieces) {
                            (None, None) => text.split_whitespace().map(Value::from).collect(),
                            (Some(sep), None) => {
                                text.split(sep.as_str()).map(Value::from).collect()
                            }
                            (Some(sep), Some(n)) => {
                                text.splitn(n, sep.as_str()).map(Value::from).collect()
                            }
                            // Whitespace with a limit: left to minijinja.
                            (None, Some(_)) => return Err(declined!()),
                        };
                        V::Own(Value::from(list))
                    }
                    Method::Replace(old, new) => {
                        let old = self.eval(old)?;
                        let new = self.eval(new)?;
                        let (old, new) = (old.value()?, new.value()?);
                        if old.kind() != ValueKind::String || new.kind() != ValueKind::String {
                            return Err(declined!());
                        }
                        let (old, new) = (
                            old.as_str().ok_or(declined!())?,
                            new.as_str().ok_or(declined!())?,
                        );
                        V::Own(Value::from(text.replace(old, new)))
                    }
                    Method::Get(..) => return Err(declined!()),
                    Method::Format(args) => {
                        // pycompat's `str.format` is minijinja's own
                        // `format_filter` in its `str.format` style.
                        let mut values = Vec::with_capacity(args.len());
                        for arg in args {
                            values.push(self.eval(arg)?.value()?.clone());
                        }
                        let text = minijinja::format_filter(
                            minijinja::FormatStyle::StrFormat,
                            text,
                            &values,
                        )
                        .map_err(|_| declined!())?;
                        if text.len() > self.max_output {
                            return Err(declined!());
                        }
                        V::Own(Value::from(text))
                    }
                }
            }
            Expr::Add(..) => {
                let mut sum = Sum::Empty;
                self.add(&mut sum, e, false)?;
                match sum {
                    Sum::Text(text) => V::Own(Value::from(text)),
                    Sum::Int(n) => V::Own(Value::from(n)),
                    // Materialized by minijinja: a plain list.
                    Sum::List(items, 0) => V::Own(Value::from(items)),
                    Sum::List(items, depth) => V::Chain(Rc::new(Chain { items, depth })),
                    Sum::Empty | Sum::Written => return Err(declined!()),
                }
            }
            Expr::Arith(op, left, right) => {
                let l = self.eval(left)?;
                let r = self.eval(right)?;
                let (l, r) = (
                    int(l.value()?).ok_or(declined!())?,
                    int(r.value()?).ok_or(declined!())?,
                );
                // minijinja computes in i128 and keeps an i64 when the
                // result fits; one that does not fit declines here. `%` is
                // Euclid's remainder, as minijinja's.
                let n = match op {
                    Arith::Sub => l.checked_sub(r),
                    Arith::Rem => l.checked_rem_euclid(r),
                };
                V::Own(Value::from(n.ok_or(declined!())?))
            }
            Expr::Decline(what) => {
                self.declined_at = Some(what);
                return Err(declined!());
            }
        })
    }

    /// `text[start:stop]` as minijinja slices a string: by characters,
    /// with its offsets (`get_offset_and_len`); a plain string.
    fn slice_text(
        &mut self,
        text: &str,
        start: &'a Option<Box<Expr>>,
        stop: &'a Option<Box<Expr>>,
    ) -> Step<V<'a>> {
        let mut bound = |e: &'a Option<Box<Expr>>| -> Step<Option<i64>> {
            let Some(e) = e else { return Ok(None) };
            let v = self.eval(e)?;
            let v = v.value()?;
            if v.is_none() {
                return Ok(None);
            }
            int(v).map(Some).ok_or(declined!())
        };
        let (start, stop) = (bound(start)?.unwrap_or(0), bound(stop)?);
        let (from, take) = if start < 0 || stop.is_none_or(|x| x < 0) {
            let end = text.chars().count() as i64;
            let from = if start < 0 {
                (end + start).max(0)
            } else {
                start
            };
            let to = match stop {
                None => end,
                Some(x) if x < 0 => (end + x).max(0),
                Some(x) => x,
            };
            (from, (to - from).max(0))
        } else {
            let stop = stop.unwrap_or(0);
            (start, (stop - start).max(0))
        };
        let piece: String = text
            .chars()
            .skip(usize::try_from(from).map_err(|_| declined!())?)
            .take(usize::try_from(take).map_err(|_| declined!())?)
            .collect();
        Ok(V::Own(Value::from(piece)))
    }

    /// Adds `e`, a `+` chain or one operand of it, to `sum` as
    /// minijinja's `+` does where that is plain: strings (of kind string;
    /// safe or not, the result is a plain string) join, integers that fit
    /// an `i64` sum without overflow; any other pair (floats, lists, a
    /// string beside a number, undefined) declines. With `write`, a chain
    /// of strings goes straight to the output: a later operand that is not
    /// a string declines the whole rendering, so nothing half-written
    /// survives.
    fn add(&mut self, sum: &mut Sum, e: &'a Expr, write: bool) -> Step<()> {
        if let Expr::Add(left, right) = e {
            self.step()?;
            self.add(sum, left, write)?;
            if matches!(sum, Sum::List(..)) && matches!(**right, Expr::Add(..)) {
                // `a + (b + c)` of sequences nests unlike a left-to-right
                // chain: minijinja's depth is not the one counted here.
                return Err(declined!());
            }
            return self.add(sum, right, write);
        }
        let v = self.eval(e)?;
        if let Some((items, depth)) = sequence_operand(&v) {
            // minijinja's `+` of two sequences or iterables: a lazy
            // concatenation one level deeper than its deeper operand,
            // made a list at once past its maximal depth.
            match sum {
                Sum::Empty => *sum = Sum::List(items.to_vec(), depth),
                Sum::List(joined, joined_depth) => {
                    if joined.len().saturating_add(items.len()) > MAX_CHAIN_ITEMS {
                        return Err(declined!());
                    }
                    joined.extend_from_slice(items);
                    let nested = (*joined_depth).max(depth) + 1;
                    *joined_depth = if nested > MERGE_MAX_DEPTH { 0 } else { nested };
                }
                _ => return Err(declined!()),
            }
            return Ok(());
        }
        let v = v.value()?;
        if v.kind() == ValueKind::String {
            let text = v.as_str().ok_or(declined!())?;
            match sum {
                Sum::Empty if write => {
                    self.write(text)?;
                    *sum = Sum::Written;
                }
                Sum::Written => self.write(text)?,
                Sum::Empty => *sum = Sum::Text(text.to_owned()),
                Sum::Text(joined) => {
                    if joined.len().saturating_add(text.len()) > self.max_output {
                        return Err(declined!());
                    }
                    joined.push_str(text);
                }
                Sum::Int(_) | Sum::List(..) => return Err(declined!()),
            }
            return Ok(());
        }
        let n = int(v).ok_or(declined!())?;
        *sum = match *sum {
            Sum::Empty => Sum::Int(n),
            Sum::Int(m) => Sum::Int(m.checked_add(n).ok_or(declined!())?),
            Sum::Text(_) | Sum::Written | Sum::List(..) => return Err(declined!()),
        };
        Ok(())
    }

    /// Appends `e`'s text as `~` does.
    fn append(&mut self, text: &mut String, e: &'a Expr) -> Step<()> {
        if let Expr::Concat(left, right) = e {
            self.step()?;
            self.append(text, left)?;
            return self.append(text, right);
        }
        if let Expr::Text(_, constant) = e {
            self.step()?;
            text.push_str(constant);
            return Ok(());
        }
        // `~` is `format!("{left}{right}")` in minijinja: each side's
        // `Display`.
        let v = self.eval(e)?;
        let v = v.value()?;
        match v.as_str() {
            Some(s) => text.push_str(s),
            None => {
                let _ = write!(text, "{v}");
            }
        }
        if text.len() > self.max_output {
            return Err(declined!());
        }
        Ok(())
    }

    fn attr(&self, base: V<'a>, name: &'a str) -> Step<V<'a>> {
        match base {
            V::Ns(ns) => Ok(self.namespaces[ns]
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(V::undefined)),
            V::Ref(value) => {
                if let Some(found) = small_map_get(value, name) {
                    return Ok(found.map_or_else(V::undefined, V::Ref));
                }
                value.get_attr(name).map(V::Own).map_err(|_| declined!())
            }
            V::Own(value) => {
                if let Some(found) = small_map_get(&value, name) {
                    return Ok(found.map_or_else(V::undefined, |v| V::Own(v.clone())));
                }
                value.get_attr(name).map(V::Own).map_err(|_| declined!())
            }
            V::Slice(_) | V::Chain(_) => Err(declined!()),
        }
    }

    fn item(&self, base: V<'a>, key: &Value) -> Step<V<'a>> {
        if let Some(i) = int(key)
            && matches!(base, V::Slice(_) | V::Chain(_))
        {
            // minijinja's iterables (a slice, a `+` of sequences) have no
            // items of their own: an integer index takes the `nth` item,
            // a negative one counted back from their known length.
            let len = base.items().map_or(0, <[Value]>::len) as i64;
            let at = if i < 0 { len + i } else { i };
            let Ok(at) = usize::try_from(at) else {
                return Ok(V::undefined());
            };
            return Ok(match &base {
                V::Slice(list) => list.get(at).map_or_else(V::undefined, V::Ref),
                V::Chain(chain) => chain
                    .items
                    .get(at)
                    .map_or_else(V::undefined, |item| V::Own(item.clone())),
                _ => return Err(declined!()),
            });
        }
        if let (Some(list), Some(i)) = (base.borrowed_items(), int(key)) {
            let len = list.len() as i64;
            let at = if i < 0 { len + i } else { i };
            return Ok(if (0..len).contains(&at) {
                V::Ref(&list[at as usize])
            } else {
                V::undefined()
            });
        }
        if let V::Ref(value) = base
            && let Some(name) = key.as_str()
            && let Some(found) = small_map_get(value, name)
        {
            return Ok(found.map_or_else(V::undefined, V::Ref));
        }
        match base {
            V::Ns(_) | V::Slice(_) | V::Chain(_) => Err(declined!()),
            other => other
                .value()?
                .get_item(key)
                .map(V::Own)
                .map_err(|_| declined!()),
        }
    }

    fn filter(&mut self, kind: &'a FilterKind, v: V<'a>) -> Step<V<'a>> {
        if let FilterKind::List = kind {
            return Ok(V::Own(Value::from(v.items().ok_or(declined!())?.to_vec())));
        }
        if let FilterKind::SelectAttrEq(attr, wanted) = kind {
            let list = v.items().ok_or(declined!())?.to_vec();
            let wanted = self.eval(wanted)?;
            let wanted = wanted.value()?;
            if wanted.is_undefined() {
                // An absent attribute is undefined too: minijinja's to
                // compare.
                return Err(declined!());
            }
            let mut kept = Vec::new();
            for item in list {
                self.step()?;
                // Items other than the request's objects (a string, a
                // dict from the context) are minijinja's to look into.
                let found = small_map_get(&item, attr).ok_or(declined!())?;
                if found.is_some_and(|x| x == wanted) {
                    kept.push(item);
                }
            }
            return Ok(V::Own(Value::from(kept)));
        }
        if let FilterKind::Join(joiner) = kind {
            let joiner = match joiner {
                Some(joiner) => {
                    let joiner = self.eval(joiner)?;
                    let joiner = joiner.value()?;
                    if joiner.kind() != ValueKind::String {
                        return Err(declined!());
                    }
                    joiner.as_str().ok_or(declined!())?.to_owned()
                }
                None => String::new(),
            };
            // With no auto-escaping minijinja joins the items' text; only
            // strings are taken here (other items print through `Display`).
            let mut joined = String::new();
            for (i, item) in v.items().ok_or(declined!())?.iter().enumerate() {
                if item.kind() != ValueKind::String {
                    return Err(declined!());
                }
                if i > 0 {
                    joined.push_str(&joiner);
                }
                joined.push_str(item.as_str().ok_or(declined!())?);
                if joined.len() > self.max_output {
                    return Err(declined!());
                }
            }
            return Ok(V::Own(Value::from(joined)));
        }
        if let FilterKind::MinMax(largest) = kind {
            // minijinja's `min` / `max`: the items' least or greatest
            // under its ordering of values, undefined when there are
            // none; taken here for integers only, whose order is theirs.
            let items = v.items().ok_or(declined!())?;
            let mut best: Option<(&Value, i64)> = None;
            for item in items {
                let n = int(item).ok_or(declined!())?;
                // Rust's `min` keeps the first least item and `max` the
                // last greatest: equal integers are the same value anyway.
                if best.is_none_or(|(_, b)| if *largest { n >= b } else { n < b }) {
                    best = Some((item, n));
                }
            }
            return Ok(best.map_or_else(V::undefined, |(item, _)| V::Own(item.clone())));
        }
        if let V::Slice(_) | V::Chain(_) = v {
            // An iterable of known length.
            let len = v.items().ok_or(declined!())?.len();
            return match kind {
                FilterKind::Length => Ok(V::Own(Value::from(len as i64))),
                FilterKind::Default(_) => Ok(v),
                _ => Err(declined!()),
            };
        }
        let value = v.value()?;
        Ok(match kind {
            // The crate's `trim`: Python's `str()` of the value, stripped.
            FilterKind::Trim => match value.as_str() {
                Some(text) if value.kind() == ValueKind::String => {
                    V::Own(Value::from(crate::template::python_strip(text)))
                }
                _ => V::Own(Value::from(crate::template::python_strip(
                    &crate::pyfilters::python_text(value),
                ))),
            },
            FilterKind::Length => match value.kind() {
                ValueKind::String => V::Own(Value::from(
                    value.as_str().ok_or(declined!())?.chars().count() as i64,
                )),
                ValueKind::Seq | ValueKind::Map => {
                    V::Own(Value::from(value.len().ok_or(declined!())? as i64))
                }
                _ => return Err(declined!()),
            },
            FilterKind::Safe => {
                if value.kind() != ValueKind::String {
                    return Err(declined!());
                }
                V::Own(Value::from_safe_string(
                    value.as_str().ok_or(declined!())?.to_owned(),
                ))
            }
            FilterKind::ToJson(options) => {
                let text = json_text(value, options).map_err(|_| declined!())?;
                V::Own(Value::from(text))
            }
            FilterKind::Default(fallback) => {
                if value.is_undefined() {
                    self.eval(fallback)?
                } else {
                    v
                }
            }
            FilterKind::DefaultFalsy(fallback) => {
                if value.is_undefined() || !value.is_true() {
                    self.eval(fallback)?
                } else {
                    v
                }
            }
            FilterKind::Upper | FilterKind::Lower => {
                // minijinja keeps a safe string safe; left to it.
                if value.kind() != ValueKind::String || value.is_safe() {
                    return Err(declined!());
                }
                let text = value.as_str().ok_or(declined!())?;
                V::Own(Value::from(if matches!(kind, FilterKind::Upper) {
                    text.to_uppercase()
                } else {
                    text.to_lowercase()
                }))
            }
            FilterKind::Replace(old, new) => {
                let text = value.clone();
                let old = self.eval(old)?;
                let new = self.eval(new)?;
                let (old, new) = (old.value()?, new.value()?);
                if [&text, old, new]
                    .iter()
                    .any(|v| v.kind() != ValueKind::String)
                {
                    return Err(declined!());
                }
                let (text, old, new) = (
                    text.as_str().ok_or(declined!())?,
                    old.as_str().ok_or(declined!())?,
                    new.as_str().ok_or(declined!())?,
                );
                // With no auto-escaping minijinja replaces in the text
                // and returns a plain string.
                V::Own(Value::from(text.replace(old, new)))
            }
            FilterKind::Int => {
                // An integer is returned as it is; anything else is
                // converted by minijinja's rules, left to it.
                if !value.is_integer() {
                    return Err(declined!());
                }
                v
            }
            FilterKind::String => {
                if value.kind() == ValueKind::String {
                    v
                } else {
                    V::Own(Value::from(crate::pyfilters::python_text(value)))
                }
            }
            FilterKind::List
            | FilterKind::SelectAttrEq(..)
            | FilterKind::Join(_)
            | FilterKind::MinMax(_) => {
                return Err(declined!());
            }
        })
    }
}

/// Whether a namespace attribute's value may be stored as it is: a
/// scalar behaves the same borrowed or owned.
fn scalar(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Undefined
            | ValueKind::None
            | ValueKind::Bool
            | ValueKind::Number
            | ValueKind::String
    )
}

impl Recording {
    fn read(&mut self, name: Name) {
        if !self.reads.contains(&name) {
            self.reads.push(name);
        }
    }
}
