//! The compiled program: statements and expressions over numbered names.

use minijinja::value::Value;

use super::Name;
use crate::tojson::JsonOptions;

pub(super) struct MacroDef {
    pub(super) params: Vec<Name>,
    /// Each parameter's default, a constant, taken when the argument is
    /// undefined (missing or passed undefined), as minijinja's prologue does.
    pub(super) defaults: Vec<Option<Value>>,
    pub(super) body: Vec<Stmt>,
}

pub(super) enum Stmt {
    Raw(Box<str>),
    Emit(Expr),
    If(Expr, Vec<Stmt>, Vec<Stmt>),
    For(Box<ForLoop>),
    Set(Name, Expr),
    /// `set name.attr = value` on a namespace; `from_closure`: `name` is
    /// read as [`Expr::Closure`] reads it.
    SetAttr {
        name: Name,
        from_closure: bool,
        attr: Box<str>,
        value: Expr,
    },
    /// `{% set x %}...{% endset %}`: the body's output, as a string.
    SetBlock(Name, Vec<Stmt>),
    /// A macro definition (the next of the top level's, in order):
    /// macros are resolved when compiling; this marks it defined.
    DefineMacro,
    /// `{% break %}` / `{% continue %}` in a loop of the same body.
    Break,
    Continue,
    /// Left to minijinja; the text names the construct.
    Decline(Box<str>),
}

pub(super) struct ForLoop {
    pub(super) target: Name,
    pub(super) iter: Expr,
    pub(super) filter: Option<Expr>,
    pub(super) body: Vec<Stmt>,
    pub(super) else_body: Vec<Stmt>,
    /// `for x in seq[::-1]`: the items last to first.
    pub(super) reversed: bool,
    /// `for k, v in map.items()` (or `map | items`): `iter` is the map,
    /// `target` takes each key and this name its value.
    pub(super) value_target: Option<Name>,
    /// `map | dictsort`: the pairs sorted by key as minijinja sorts them.
    pub(super) sorted: bool,
    /// `for i in range(...)`: its one to three arguments (then `iter` is
    /// unused).
    pub(super) range: Option<Vec<Expr>>,
}

pub(super) enum Expr {
    Const(Value),
    /// A string constant: its value, and its text to print as is.
    Text(Value, Box<str>),
    Var(Name),
    /// A name a macro reads from the top level (minijinja's closure): the
    /// top level's current binding, else the context's value.
    Closure(Name),
    Loop(LoopAttr),
    Attr(Box<Expr>, Box<str>),
    Item(Box<Expr>, Box<Expr>),
    Slice(Box<Expr>, Option<Box<Expr>>, Option<Box<Expr>>),
    Not(Box<Expr>),
    Neg(Box<Expr>),
    Concat(Box<Expr>, Box<Expr>),
    /// `+`: two strings joined, or two integers summed.
    Add(Box<Expr>, Box<Expr>),
    /// `-` or `%` between two integers.
    Arith(Arith, Box<Expr>, Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Compare(Box<Expr>, Cmp, Box<Expr>),
    Cond(Box<Expr>, Box<Expr>, Option<Box<Expr>>),
    Test(TestKind, Box<Expr>),
    Filter(FilterKind, Box<Expr>),
    List(Vec<Expr>),
    /// A dict literal that is not a constant: its key and value pairs.
    Map(Vec<(Expr, Expr)>),
    /// A call of the top level's macro of that index: each argument with
    /// the parameter it binds, in the call's order.
    CallMacro(usize, Vec<(usize, Expr)>),
    Namespace(Vec<(Box<str>, Expr)>),
    StrftimeNow(Box<Expr>),
    Method(Box<Expr>, Method),
    /// Left to minijinja; the text names the construct.
    Decline(Box<str>),
}

#[derive(Clone, Copy)]
pub(super) enum LoopAttr {
    Index0,
    Index,
    RevIndex0,
    RevIndex,
    First,
    Last,
    Length,
    PrevItem,
    NextItem,
}

#[derive(Clone, Copy)]
pub(super) enum Arith {
    Sub,
    Rem,
}

#[derive(Clone, Copy)]
pub(super) enum Cmp {
    Eq,
    Ne,
    Lt,
    Lte,
    Gt,
    Gte,
    In,
    NotIn,
}

#[derive(Clone, Copy)]
pub(super) enum TestKind {
    Defined,
    Undefined,
    None,
    String,
    Sequence,
    Mapping,
    Number,
    Boolean,
    Iterable,
    True,
    False,
}

pub(super) enum FilterKind {
    Trim,
    Length,
    Safe,
    ToJson(JsonOptions),
    Default(Box<Expr>),
    /// jinja2's `string` (the crate's: Python's `str()`).
    String,
    /// `default(x, true)`: `x` for an undefined or false value.
    DefaultFalsy(Box<Expr>),
    Upper,
    Lower,
    /// The `replace(old, new)` filter on a string.
    Replace(Box<Expr>, Box<Expr>),
    /// `int` of an integer (itself).
    Int,
    /// `join` of a sequence of strings, with the joiner or none.
    Join(Option<Box<Expr>>),
    /// `list` of a sequence: its items as a new list.
    List,
    /// `min` (false) or `max` (true) of a sequence of integers.
    MinMax(bool),
    /// `selectattr(name, "equalto", value) | list`: the items whose
    /// attribute `name` equals `value`.
    SelectAttrEq(Box<str>, Box<Expr>),
}

pub(super) enum Method {
    Strip,
    LStrip,
    RStrip,
    StartsWith(Box<Expr>),
    EndsWith(Box<Expr>),
    /// `strip`, `lstrip`, `rstrip` with the characters to strip.
    StripChars(Side, Box<Expr>),
    /// `split()`, `split(sep)`, `split(sep, maxsplit)`.
    Split(Option<Box<Expr>>, Option<Box<Expr>>),
    Replace(Box<Expr>, Box<Expr>),
    /// A mapping's `get(key)` or `get(key, default)`.
    Get(Box<Expr>, Option<Box<Expr>>),
    /// A string's `format(...)` with positional arguments.
    Format(Vec<Expr>),
}

#[derive(Clone, Copy)]
pub(super) enum Side {
    Both,
    Start,
    End,
}
