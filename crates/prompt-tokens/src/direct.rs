//! Direct rendering: a chat template's syntax tree walked over the
//! request's values, without minijinja's virtual machine.
//!
//! minijinja spends most of a chat template's rendering on its generality:
//! instruction dispatch and fuel, a clone and a drop of every value it
//! touches, dynamic calls to print a value, loops through the generic
//! object protocol, and `~` through `format!`. Chat templates use a small
//! part of Jinja, over values of a few shapes (lists of small maps of
//! strings). This module compiles that part, from minijinja's own parser
//! (so the whitespace rules and the syntax are minijinja's), into a tree it
//! walks directly: variables are numbered, message fields are read in
//! place, `~` chains and `{{ macro(...) }}` are written straight into the
//! output.
//!
//! It is an accelerator, never a second opinion. Whatever it does not
//! handle exactly as minijinja does, it declines:
//!
//! - at compile time, a template with a construct whose meaning is global
//!   (`extends`, `block`, `include`, `import`, `autoescape`, a macro defined
//!   inside a block or defined twice) is not compiled at all;
//! - every other unsupported statement or expression becomes a node that
//!   declines when it is reached, so a template whose rare branch calls
//!   `raise_exception` or `range` still renders directly on the common one;
//! - at run time, any operation outside the cases it knows to be plain
//!   (an attribute of an undefined value, `<` between non-integers, a
//!   loop over a string or a map, a filter on a value of another type), an
//!   output over the cap, a step count over its share of the fuel, or a
//!   context that shadows a function the template calls.
//!
//! Values print as the template's formatter prints them (Python's
//! `str()` for None, booleans, numbers, lists and dicts, module `pyrepr`;
//! `~` joins through minijinja's own `Display`, as minijinja's `~` does),
//! and equality is minijinja's own `==`, so those cannot drift.
//!
//! A declined rendering is redone by minijinja from the start, so errors
//! (`raise_exception`, fuel, output cap) are always minijinja's, and a
//! successful direct rendering equals minijinja's text — differential tests
//! and a fuzz target hold it to that.

use std::fmt::Write as _;

use minijinja::machinery::{WhitespaceConfig, ast, parse};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Value, ValueKind};

use crate::request::{small_map_entries, small_map_get};
use crate::template::{JsonOptions, json_text, strftime_cached};

/// Why a rendering was not done directly; minijinja redoes it.
#[derive(Debug)]
pub(crate) struct Declined;

type Step<T> = Result<T, Declined>;

/// A variable's number: its index in the template's name table.
type Name = u16;

/// How many of minijinja's instructions one step of this renderer may
/// stand for, at most: a rendering declines once its steps times this
/// exceed the fuel, so a direct rendering never succeeds where minijinja
/// would run out of fuel.
const FUEL_PER_STEP: u64 = 8;

/// Macro calls nested deeper than this decline (minijinja's recursion
/// limit is set to 100 in [`crate::template`]).
const MAX_MACRO_DEPTH: usize = 64;

/// A chat template compiled for direct rendering.
pub(crate) struct DirectTemplate {
    body: Vec<Stmt>,
    macros: Vec<MacroDef>,
    names: Vec<Box<str>>,
    /// Functions the template calls by name (`namespace`,
    /// `strftime_now`): a context value of the same name would shadow
    /// them in minijinja, so a rendering with one declines.
    called_builtins: Vec<Name>,
}

struct MacroDef {
    params: Vec<Name>,
    body: Vec<Stmt>,
}

enum Stmt {
    Raw(Box<str>),
    Emit(Expr),
    If(Expr, Vec<Stmt>, Vec<Stmt>),
    For(Box<ForLoop>),
    Set(Name, Expr),
    SetAttr(Name, Box<str>, Expr),
    /// A macro definition: macros are resolved when compiling.
    Nothing,
    Decline,
}

struct ForLoop {
    target: Name,
    iter: Expr,
    filter: Option<Expr>,
    body: Vec<Stmt>,
    else_body: Vec<Stmt>,
}

enum Expr {
    Const(Value),
    /// A string constant: its value, and its text to print as is.
    Text(Value, Box<str>),
    Var(Name),
    Loop(LoopAttr),
    Attr(Box<Expr>, Box<str>),
    Item(Box<Expr>, Box<Expr>),
    Slice(Box<Expr>, Option<Box<Expr>>, Option<Box<Expr>>),
    Not(Box<Expr>),
    Neg(Box<Expr>),
    Concat(Box<Expr>, Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Compare(Box<Expr>, Cmp, Box<Expr>),
    Cond(Box<Expr>, Box<Expr>, Option<Box<Expr>>),
    Test(TestKind, Box<Expr>),
    Filter(FilterKind, Box<Expr>),
    List(Vec<Expr>),
    CallMacro(usize, Vec<Expr>),
    Namespace(Vec<(Box<str>, Expr)>),
    StrftimeNow(Box<Expr>),
    Method(Box<Expr>, Method),
    Decline,
}

#[derive(Clone, Copy)]
enum LoopAttr {
    Index0,
    Index,
    RevIndex0,
    RevIndex,
    First,
    Last,
    Length,
}

#[derive(Clone, Copy)]
enum Cmp {
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
enum TestKind {
    Defined,
    Undefined,
    None,
    String,
    Sequence,
    Mapping,
    Number,
    Boolean,
}

enum FilterKind {
    Trim,
    Length,
    Safe,
    ToJson(JsonOptions),
    Default(Box<Expr>),
}

enum Method {
    Strip,
    LStrip,
    RStrip,
    StartsWith(Box<Expr>),
    EndsWith(Box<Expr>),
}

/// minijinja's global functions other than the ones this module runs; a
/// bare or called reference to one declines.
const OTHER_GLOBALS: [&str; 7] = [
    "range",
    "dict",
    "debug",
    "lipsum",
    "cycler",
    "joiner",
    "raise_exception",
];

impl DirectTemplate {
    /// Compiles `source` as minijinja parses it with `trim_blocks` and
    /// `lstrip_blocks` on. `Err` names the construct that keeps the
    /// template on minijinja.
    pub(crate) fn compile(source: &str) -> Result<Self, String> {
        let whitespace = WhitespaceConfig {
            keep_trailing_newline: false,
            lstrip_blocks: true,
            trim_blocks: true,
        };
        // A unit struct without minijinja's `custom_syntax` feature, a
        // struct with it: `default()` builds either.
        #[allow(clippy::default_constructed_unit_structs)]
        let syntax = SyntaxConfig::default();
        let tree = parse(source, "chat", syntax, whitespace)
            .map_err(|e| format!("does not parse: {e}"))?;
        let ast::Stmt::Template(root) = &tree else {
            return Err("the parser did not return a template".into());
        };
        let mut assigned = Vec::new();
        collect_assigned(&root.children, &mut assigned);
        let mut compiler = Compiler {
            names: Vec::new(),
            macros: Vec::new(),
            macro_names: Vec::new(),
            assigned_outside_macros: assigned,
            called_builtins: Vec::new(),
            scope: Scope::default(),
        };
        let body = compiler.block(&root.children, true)?;
        let macros = compiler.macros;
        Ok(Self {
            body,
            macros,
            names: compiler.names,
            called_builtins: compiler.called_builtins,
        })
    }

    /// Renders with the context `globals` (name, value pairs, each name
    /// once), or declines.
    pub(crate) fn render(
        &self,
        globals: &[(Value, Value)],
        clock_seconds: &dyn Fn() -> i64,
        max_output: usize,
        fuel: u64,
        capacity: usize,
    ) -> Result<String, Declined> {
        let mut by_name: Vec<Option<&Value>> = vec![None; self.names.len()];
        for (key, value) in globals {
            let Some(key) = key.as_str() else { continue };
            if let Some(at) = self.names.iter().position(|n| **n == *key) {
                by_name[at] = Some(value);
            }
        }
        if self
            .called_builtins
            .iter()
            .any(|&n| by_name[usize::from(n)].is_some())
        {
            return Err(Declined);
        }
        let mut run = Run {
            template: self,
            globals: by_name,
            vars: Vec::with_capacity(16),
            barrier: 0,
            loops: Vec::with_capacity(4),
            namespaces: Vec::new(),
            out: String::with_capacity(capacity.min(max_output)),
            max_output,
            steps_left: fuel / FUEL_PER_STEP,
            depth: 0,
            clock_seconds,
        };
        run.exec(&self.body)?;
        Ok(run.out)
    }
}

/// Names assigned outside macro bodies (`set`, loop targets, `with`,
/// block sets): a macro that reads one would see minijinja's closure of
/// it, which this module does not model.
fn collect_assigned<'s>(stmts: &[ast::Stmt<'s>], into: &mut Vec<&'s str>) {
    fn targets<'s>(expr: &ast::Expr<'s>, into: &mut Vec<&'s str>) {
        match expr {
            ast::Expr::Var(v) => into.push(v.id),
            ast::Expr::List(l) => l.items.iter().for_each(|e| targets(e, into)),
            _ => {}
        }
    }
    for stmt in stmts {
        match stmt {
            ast::Stmt::Template(t) => collect_assigned(&t.children, into),
            ast::Stmt::Set(s) => targets(&s.target, into),
            ast::Stmt::SetBlock(s) => {
                targets(&s.target, into);
                collect_assigned(&s.body, into);
            }
            ast::Stmt::ForLoop(f) => {
                targets(&f.target, into);
                collect_assigned(&f.body, into);
                collect_assigned(&f.else_body, into);
            }
            ast::Stmt::IfCond(i) => {
                collect_assigned(&i.true_body, into);
                collect_assigned(&i.false_body, into);
            }
            ast::Stmt::WithBlock(w) => {
                for (target, _) in &w.assignments {
                    targets(target, into);
                }
                collect_assigned(&w.body, into);
            }
            ast::Stmt::AutoEscape(a) => collect_assigned(&a.body, into),
            ast::Stmt::FilterBlock(f) => collect_assigned(&f.body, into),
            _ => {}
        }
    }
}

#[derive(Default, Clone)]
struct Scope {
    /// Inside a macro body: its parameters.
    macro_locals: Option<Vec<String>>,
    /// How many `for` loops enclose the node, within the macro or the
    /// top level.
    loop_depth: usize,
    /// Set when a `loop.*` attribute of the innermost loop is compiled.
    loop_used: bool,
}

struct Compiler<'s> {
    names: Vec<Box<str>>,
    macros: Vec<MacroDef>,
    macro_names: Vec<&'s str>,
    assigned_outside_macros: Vec<&'s str>,
    called_builtins: Vec<Name>,
    scope: Scope,
}

impl<'s> Compiler<'s> {
    fn name(&mut self, id: &str) -> Result<Name, String> {
        if let Some(at) = self.names.iter().position(|n| **n == *id) {
            return Ok(at as Name);
        }
        let at = Name::try_from(self.names.len()).map_err(|_| "too many names".to_owned())?;
        self.names.push(id.into());
        Ok(at)
    }

    fn is_macro(&self, id: &str) -> Option<usize> {
        self.macro_names.iter().position(|n| *n == id)
    }

    fn block(&mut self, stmts: &[ast::Stmt<'s>], top: bool) -> Result<Vec<Stmt>, String> {
        stmts.iter().map(|s| self.stmt(s, top)).collect()
    }

    fn stmt(&mut self, stmt: &ast::Stmt<'s>, top: bool) -> Result<Stmt, String> {
        Ok(match stmt {
            ast::Stmt::Template(t) => {
                return Err(format!("a nested template ({} nodes)", t.children.len()));
            }
            ast::Stmt::EmitRaw(r) => Stmt::Raw(r.raw.into()),
            ast::Stmt::EmitExpr(e) => match self.expr(&e.expr)? {
                Expr::Text(_, text) => Stmt::Raw(text),
                other => Stmt::Emit(other),
            },
            ast::Stmt::IfCond(i) => Stmt::If(
                self.expr(&i.expr)?,
                self.block(&i.true_body, false)?,
                self.block(&i.false_body, false)?,
            ),
            ast::Stmt::ForLoop(f) => self.for_loop(f)?,
            ast::Stmt::Set(s) => match &s.target {
                ast::Expr::Var(v) => {
                    if self.is_macro(v.id).is_some() || v.id == "loop" {
                        return Err(format!("`set` of `{}`", v.id));
                    }
                    if is_builtin(v.id) {
                        return Ok(Stmt::Decline);
                    }
                    let value = self.expr(&s.expr)?;
                    Stmt::Set(self.name(v.id)?, value)
                }
                ast::Expr::GetAttr(a) => match &a.expr {
                    ast::Expr::Var(v) if self.readable(v.id) => {
                        Stmt::SetAttr(self.name(v.id)?, a.name.into(), self.expr(&s.expr)?)
                    }
                    _ => Stmt::Decline,
                },
                _ => Stmt::Decline,
            },
            ast::Stmt::Macro(m) => {
                if !top || self.is_macro(m.name).is_some() {
                    return Err(format!(
                        "macro `{}` defined inside a block or twice",
                        m.name
                    ));
                }
                if self.assigned_outside_macros.contains(&m.name) {
                    return Err(format!("macro `{}` is also assigned", m.name));
                }
                let mut params = Vec::new();
                let mut locals = Vec::new();
                for arg in &m.args {
                    let ast::Expr::Var(v) = arg else {
                        return Err(format!("macro `{}` has an unusual parameter", m.name));
                    };
                    if is_builtin(v.id) {
                        return Err(format!("macro `{}` has a parameter `{}`", m.name, v.id));
                    }
                    params.push(self.name(v.id)?);
                    locals.push(v.id.to_owned());
                }
                let body = if m.defaults.is_empty() {
                    let outer = std::mem::replace(
                        &mut self.scope,
                        Scope {
                            macro_locals: Some(locals),
                            ..Scope::default()
                        },
                    );
                    let body = self.block(&m.body, false);
                    self.scope = outer;
                    body?
                } else {
                    vec![Stmt::Decline]
                };
                self.macro_names.push(m.name);
                self.macros.push(MacroDef { params, body });
                Stmt::Nothing
            }
            ast::Stmt::Extends(_)
            | ast::Stmt::Block(_)
            | ast::Stmt::Include(_)
            | ast::Stmt::Import(_)
            | ast::Stmt::FromImport(_)
            | ast::Stmt::AutoEscape(_) => {
                return Err("template inheritance, includes, imports or autoescape".into());
            }
            _ => Stmt::Decline,
        })
    }

    fn for_loop(&mut self, f: &ast::ForLoop<'s>) -> Result<Stmt, String> {
        let ast::Expr::Var(target) = &f.target else {
            return Ok(Stmt::Decline);
        };
        if f.recursive
            || target.id == "loop"
            || is_builtin(target.id)
            || self.is_macro(target.id).is_some()
        {
            return Ok(Stmt::Decline);
        }
        let iter = self.expr(&f.iter)?;
        let else_body = self.block(&f.else_body, false)?;
        let target = self.name(target.id)?;
        let outer_used = self.scope.loop_used;
        self.scope.loop_depth += 1;
        self.scope.loop_used = false;
        let filter = f.filter_expr.as_ref().map(|e| self.expr(e)).transpose();
        let body = self.block(&f.body, false);
        let used = self.scope.loop_used;
        self.scope.loop_depth -= 1;
        self.scope.loop_used = outer_used;
        let (filter, body) = (filter?, body?);
        if filter.is_some() && used {
            // `loop` over a filtered sequence counts the kept items only;
            // left to minijinja.
            return Ok(Stmt::Decline);
        }
        Ok(Stmt::For(Box::new(ForLoop {
            target,
            iter,
            filter,
            body,
            else_body,
        })))
    }

    /// Whether a variable may be read here: inside a macro, only its
    /// parameters and names the template never assigns outside macros
    /// (anything else would be minijinja's closure of the macro).
    fn readable(&self, id: &str) -> bool {
        match &self.scope.macro_locals {
            Some(locals) => {
                locals.iter().any(|l| l == id) || !self.assigned_outside_macros.contains(&id)
            }
            None => true,
        }
    }

    fn boxed(&mut self, e: &ast::Expr<'s>) -> Result<Box<Expr>, String> {
        self.expr(e).map(Box::new)
    }

    fn expr(&mut self, e: &ast::Expr<'s>) -> Result<Expr, String> {
        // minijinja's code generator folds constant expressions first (its
        // `and` of constants is `false` when either side is false, where
        // the running `and` returns the operand): fold the same.
        if let Some(value) = e.as_const() {
            return Ok(match value.as_str() {
                Some(text) => {
                    let text = text.into();
                    Expr::Text(value, text)
                }
                None => Expr::Const(value),
            });
        }
        Ok(match e {
            ast::Expr::Var(v) => {
                let id = v.id;
                if id == "loop"
                    || id == "namespace"
                    || id == "strftime_now"
                    || OTHER_GLOBALS.contains(&id)
                    || self.is_macro(id).is_some()
                    || !self.readable(id)
                    || (self.scope.macro_locals.is_some() && MACRO_GLOBALS.contains(&id))
                {
                    Expr::Decline
                } else {
                    Expr::Var(self.name(id)?)
                }
            }
            ast::Expr::Const(c) => Expr::Const(c.value.clone()),
            ast::Expr::Slice(s) => {
                if s.step.is_some() {
                    Expr::Decline
                } else {
                    let start = s.start.as_ref().map(|x| self.boxed(x)).transpose()?;
                    let stop = s.stop.as_ref().map(|x| self.boxed(x)).transpose()?;
                    Expr::Slice(self.boxed(&s.expr)?, start, stop)
                }
            }
            ast::Expr::UnaryOp(u) => match u.op {
                ast::UnaryOpKind::Not => Expr::Not(self.boxed(&u.expr)?),
                ast::UnaryOpKind::Neg => Expr::Neg(self.boxed(&u.expr)?),
            },
            ast::Expr::BinOp(b) => {
                let (left, right) = (self.boxed(&b.left)?, self.boxed(&b.right)?);
                match b.op {
                    ast::BinOpKind::Concat => Expr::Concat(left, right),
                    ast::BinOpKind::ScAnd => Expr::And(left, right),
                    ast::BinOpKind::ScOr => Expr::Or(left, right),
                    ast::BinOpKind::Eq => Expr::Compare(left, Cmp::Eq, right),
                    ast::BinOpKind::Ne => Expr::Compare(left, Cmp::Ne, right),
                    ast::BinOpKind::Lt => Expr::Compare(left, Cmp::Lt, right),
                    ast::BinOpKind::Lte => Expr::Compare(left, Cmp::Lte, right),
                    ast::BinOpKind::Gt => Expr::Compare(left, Cmp::Gt, right),
                    ast::BinOpKind::Gte => Expr::Compare(left, Cmp::Gte, right),
                    ast::BinOpKind::In => Expr::Compare(left, Cmp::In, right),
                    _ => Expr::Decline,
                }
            }
            ast::Expr::Compare(c) => {
                if c.ops.len() != 1 {
                    Expr::Decline
                } else {
                    let op = match c.ops[0].op {
                        ast::CompareOpKind::Eq => Cmp::Eq,
                        ast::CompareOpKind::Ne => Cmp::Ne,
                        ast::CompareOpKind::Lt => Cmp::Lt,
                        ast::CompareOpKind::Lte => Cmp::Lte,
                        ast::CompareOpKind::Gt => Cmp::Gt,
                        ast::CompareOpKind::Gte => Cmp::Gte,
                        ast::CompareOpKind::In => Cmp::In,
                        ast::CompareOpKind::NotIn => Cmp::NotIn,
                    };
                    Expr::Compare(self.boxed(&c.expr)?, op, self.boxed(&c.ops[0].expr)?)
                }
            }
            ast::Expr::IfExpr(i) => Expr::Cond(
                self.boxed(&i.test_expr)?,
                self.boxed(&i.true_expr)?,
                i.false_expr.as_ref().map(|x| self.boxed(x)).transpose()?,
            ),
            ast::Expr::Filter(f) => self.filter(f)?,
            ast::Expr::Test(t) => {
                let kind = match t.name {
                    "defined" => TestKind::Defined,
                    "undefined" => TestKind::Undefined,
                    "none" => TestKind::None,
                    "string" => TestKind::String,
                    "sequence" => TestKind::Sequence,
                    "mapping" => TestKind::Mapping,
                    "number" => TestKind::Number,
                    "boolean" => TestKind::Boolean,
                    _ => return Ok(Expr::Decline),
                };
                if !t.args.is_empty() {
                    return Ok(Expr::Decline);
                }
                Expr::Test(kind, self.boxed(&t.expr)?)
            }
            ast::Expr::GetAttr(a) => match &a.expr {
                ast::Expr::Var(v) if v.id == "loop" => {
                    if self.scope.loop_depth == 0 {
                        return Ok(Expr::Decline);
                    }
                    self.scope.loop_used = true;
                    match a.name {
                        "index0" => Expr::Loop(LoopAttr::Index0),
                        "index" => Expr::Loop(LoopAttr::Index),
                        "revindex0" => Expr::Loop(LoopAttr::RevIndex0),
                        "revindex" => Expr::Loop(LoopAttr::RevIndex),
                        "first" => Expr::Loop(LoopAttr::First),
                        "last" => Expr::Loop(LoopAttr::Last),
                        "length" => Expr::Loop(LoopAttr::Length),
                        _ => Expr::Decline,
                    }
                }
                base => Expr::Attr(self.boxed(base)?, a.name.into()),
            },
            ast::Expr::GetItem(g) => {
                Expr::Item(self.boxed(&g.expr)?, self.boxed(&g.subscript_expr)?)
            }
            ast::Expr::Call(c) => self.call(c)?,
            ast::Expr::List(l) => Expr::List(
                l.items
                    .iter()
                    .map(|x| self.expr(x))
                    .collect::<Result<_, _>>()?,
            ),
            ast::Expr::Map(_) => Expr::Decline,
        })
    }

    fn positional(&mut self, args: &[ast::CallArg<'s>]) -> Result<Option<Vec<Expr>>, String> {
        let mut out = Vec::with_capacity(args.len());
        for arg in args {
            match arg {
                ast::CallArg::Pos(e) => out.push(self.expr(e)?),
                _ => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    fn filter(&mut self, f: &ast::Filter<'s>) -> Result<Expr, String> {
        let Some(operand) = &f.expr else {
            return Ok(Expr::Decline);
        };
        let kind = match (f.name, f.args.as_slice()) {
            ("trim", []) => FilterKind::Trim,
            ("length" | "count", []) => FilterKind::Length,
            ("safe", []) => FilterKind::Safe,
            ("default" | "d", [ast::CallArg::Pos(fallback)]) => {
                FilterKind::Default(self.boxed(fallback)?)
            }
            ("tojson", args) => match tojson_options(args) {
                Some(options) => FilterKind::ToJson(options),
                None => return Ok(Expr::Decline),
            },
            _ => return Ok(Expr::Decline),
        };
        Ok(Expr::Filter(kind, self.boxed(operand)?))
    }

    fn call(&mut self, c: &ast::Call<'s>) -> Result<Expr, String> {
        match c.identify_call() {
            ast::CallType::Function(name) => {
                if let Some(index) = self.is_macro(name) {
                    let Some(args) = self.positional(&c.args)? else {
                        return Ok(Expr::Decline);
                    };
                    if args.len() > self.macros[index].params.len() {
                        return Ok(Expr::Decline);
                    }
                    return Ok(Expr::CallMacro(index, args));
                }
                if self.assigned_outside_macros.contains(&name) {
                    return Ok(Expr::Decline);
                }
                match name {
                    "namespace" => {
                        let mut fields = Vec::with_capacity(c.args.len());
                        for arg in &c.args {
                            let ast::CallArg::Kwarg(key, value) = arg else {
                                return Ok(Expr::Decline);
                            };
                            fields.push(((*key).into(), self.expr(value)?));
                        }
                        let id = self.name(name)?;
                        self.called_builtins.push(id);
                        Ok(Expr::Namespace(fields))
                    }
                    "strftime_now" => match self.positional(&c.args)? {
                        Some(mut args) if args.len() == 1 => {
                            let id = self.name(name)?;
                            self.called_builtins.push(id);
                            Ok(Expr::StrftimeNow(Box::new(args.remove(0))))
                        }
                        _ => Ok(Expr::Decline),
                    },
                    _ => Ok(Expr::Decline),
                }
            }
            ast::CallType::Method(base, name) => {
                let Some(mut args) = self.positional(&c.args)? else {
                    return Ok(Expr::Decline);
                };
                let method = match (name, args.len()) {
                    ("strip", 0) => Method::Strip,
                    ("lstrip", 0) => Method::LStrip,
                    ("rstrip", 0) => Method::RStrip,
                    ("startswith", 1) => Method::StartsWith(Box::new(args.remove(0))),
                    ("endswith", 1) => Method::EndsWith(Box::new(args.remove(0))),
                    _ => return Ok(Expr::Decline),
                };
                Ok(Expr::Method(self.boxed(base)?, method))
            }
            _ => Ok(Expr::Decline),
        }
    }
}

/// `tojson`'s options from constant keyword arguments (`indent` as an
/// integer, `sort_keys`, `ensure_ascii`); anything else is minijinja's.
fn tojson_options(args: &[ast::CallArg<'_>]) -> Option<JsonOptions> {
    let mut indent = None;
    let mut sort_keys = false;
    let mut ensure_ascii = false;
    for arg in args {
        let ast::CallArg::Kwarg(key, ast::Expr::Const(value)) = arg else {
            return None;
        };
        let value = &value.value;
        match *key {
            "indent" if value.is_none() => indent = None,
            "indent" => indent = Some(usize::try_from(value.as_i64()?).ok()?),
            "sort_keys" if value.kind() == ValueKind::Bool => sort_keys = value.is_true(),
            "ensure_ascii" if value.kind() == ValueKind::Bool => ensure_ascii = value.is_true(),
            _ => return None,
        }
    }
    Some(JsonOptions::new(
        indent.map(|n| " ".repeat(n.min(64))),
        None,
        sort_keys,
        ensure_ascii,
    ))
}

/// Whether `id` names a function this module runs or minijinja defines:
/// a variable of that name (a `set`, a loop target, a macro parameter)
/// would shadow it, which is left to minijinja.
fn is_builtin(id: &str) -> bool {
    id == "namespace"
        || id == "strftime_now"
        || OTHER_GLOBALS.contains(&id)
        || MACRO_GLOBALS.contains(&id)
}

/// Names minijinja defines inside a macro body.
const MACRO_GLOBALS: [&str; 4] = ["varargs", "kwargs", "caller", "self"];

static UNDEFINED: Value = Value::UNDEFINED;

/// A value during a rendering: borrowed from the template or the context
/// where possible, owned where computed.
#[derive(Clone)]
enum V<'a> {
    Ref(&'a Value),
    Own(Value),
    /// A `namespace()` object: an index into [`Run::namespaces`].
    Ns(usize),
    /// A slice of a borrowed sequence (`messages[1:]`), not copied.
    Slice(&'a [Value]),
}

impl<'a> V<'a> {
    fn value(&self) -> Step<&Value> {
        match self {
            V::Ref(v) => Ok(v),
            V::Own(v) => Ok(v),
            V::Ns(_) | V::Slice(_) => Err(Declined),
        }
    }

    /// The items when the value is a sequence of plain vector shape.
    fn items(&self) -> Option<&[Value]> {
        match self {
            V::Ref(v) => items(v),
            V::Own(v) => items(v),
            V::Slice(list) => Some(list),
            V::Ns(_) => None,
        }
    }

    /// The items borrowed for the whole rendering, when they are.
    fn borrowed_items(&self) -> Option<&'a [Value]> {
        match *self {
            V::Ref(v) => items(v),
            V::Slice(list) => Some(list),
            _ => None,
        }
    }

    fn undefined() -> Self {
        V::Ref(&UNDEFINED)
    }

    fn bool(yes: bool) -> Self {
        V::Own(Value::from(yes))
    }
}

/// The items of a sequence value, when it is one minijinja would index
/// and iterate as a plain vector.
fn items(value: &Value) -> Option<&[Value]> {
    if value.kind() != ValueKind::Seq {
        return None;
    }
    value.downcast_object_ref::<Vec<Value>>().map(Vec::as_slice)
}

/// An integer, when `value` is one that prints and compares as an `i64`.
fn int(value: &Value) -> Option<i64> {
    if value.kind() == ValueKind::Number && value.is_integer() {
        value.as_i64()
    } else {
        None
    }
}

struct LoopState {
    index: usize,
    len: usize,
}

struct Run<'a> {
    template: &'a DirectTemplate,
    globals: Vec<Option<&'a Value>>,
    vars: Vec<(Name, V<'a>)>,
    /// Lookups in `vars` stop here: the start of the running macro's frame.
    barrier: usize,
    loops: Vec<LoopState>,
    namespaces: Vec<Vec<(&'a str, V<'a>)>>,
    out: String,
    max_output: usize,
    steps_left: u64,
    depth: usize,
    clock_seconds: &'a dyn Fn() -> i64,
}

impl<'a> Run<'a> {
    fn step(&mut self) -> Step<()> {
        self.steps_left = self.steps_left.checked_sub(1).ok_or(Declined)?;
        Ok(())
    }

    fn write(&mut self, text: &str) -> Step<()> {
        if self.out.len().saturating_add(text.len()) > self.max_output {
            return Err(Declined);
        }
        self.out.push_str(text);
        Ok(())
    }

    fn exec(&mut self, stmts: &'a [Stmt]) -> Step<()> {
        for stmt in stmts {
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
                Stmt::SetAttr(name, attr, e) => {
                    let V::Ns(ns) = self.lookup(*name) else {
                        return Err(Declined);
                    };
                    let value = self.eval(e)?;
                    let fields = &mut self.namespaces[ns];
                    match fields.iter_mut().find(|(k, _)| *k == &**attr) {
                        Some(slot) => slot.1 = value,
                        None => fields.push((attr, value)),
                    }
                }
                Stmt::Nothing => {}
                Stmt::Decline => return Err(Declined),
            }
        }
        Ok(())
    }

    fn for_loop(&mut self, f: &'a ForLoop) -> Step<()> {
        let seq = self.eval(&f.iter)?;
        let borrowed = seq.borrowed_items();
        let len = match seq.items() {
            Some(list) => list.len(),
            None if seq.value()?.is_undefined() => 0,
            None => return Err(Declined),
        };
        self.loops.push(LoopState { index: 0, len });
        let mut ran = false;
        for index in 0..len {
            self.step()?;
            let item = match borrowed {
                Some(list) => V::Ref(&list[index]),
                None => V::Own(seq.items().ok_or(Declined)?[index].clone()),
            };
            let mark = self.vars.len();
            self.vars.push((f.target, item));
            if let Some(filter) = &f.filter {
                // minijinja runs a filtered loop's items twice: once to
                // filter, once for the body.
                self.step()?;
                if !self.test(filter)? {
                    self.vars.truncate(mark);
                    continue;
                }
            }
            ran = true;
            if let Some(state) = self.loops.last_mut() {
                state.index = index;
            }
            self.exec(&f.body)?;
            self.vars.truncate(mark);
        }
        self.loops.pop();
        if !ran {
            // minijinja runs `else` in the enclosing scope: its `set`s stay.
            self.exec(&f.else_body)?;
        }
        Ok(())
    }

    /// Whether `v` is true as minijinja's `if` decides.
    fn truthy(&self, v: &V<'a>) -> Step<bool> {
        match v {
            V::Ref(value) => Ok(value.is_true()),
            V::Own(value) => Ok(value.is_true()),
            // A namespace is a map: true once it has a field.
            V::Ns(ns) => Ok(!self.namespaces[*ns].is_empty()),
            // minijinja's slice is a lazy iterable; left to it.
            V::Slice(_) => Err(Declined),
        }
    }

    /// Evaluates `e` and decides whether it is true.
    fn test(&mut self, e: &'a Expr) -> Step<bool> {
        let v = self.eval(e)?;
        self.truthy(&v)
    }

    fn lookup(&self, name: Name) -> V<'a> {
        for (n, value) in self.vars[self.barrier..].iter().rev() {
            if *n == name {
                return value.clone();
            }
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
            return Err(Declined);
        }
        Ok(())
    }

    fn call_macro(&mut self, index: usize, args: &'a [Expr]) -> Step<()> {
        self.step()?;
        let def = &self.template.macros[index];
        if self.depth >= MAX_MACRO_DEPTH {
            return Err(Declined);
        }
        let mut values = Vec::with_capacity(def.params.len());
        for arg in args {
            values.push(self.eval(arg)?);
        }
        let mark = self.vars.len();
        let outer_barrier = std::mem::replace(&mut self.barrier, mark);
        let mut values = values.into_iter();
        for &param in &def.params {
            // minijinja spends an instruction binding each parameter.
            self.step()?;
            let value = values.next().unwrap_or_else(V::undefined);
            self.vars.push((param, value));
        }
        self.depth += 1;
        let done = self.exec(&def.body);
        self.depth -= 1;
        self.vars.truncate(mark);
        self.barrier = outer_barrier;
        done
    }

    fn capture_macro(&mut self, index: usize, args: &'a [Expr]) -> Step<V<'a>> {
        let outer = std::mem::take(&mut self.out);
        let done = self.call_macro(index, args);
        let text = std::mem::replace(&mut self.out, outer);
        done?;
        Ok(V::Own(Value::from(text)))
    }

    fn eval(&mut self, e: &'a Expr) -> Step<V<'a>> {
        self.step()?;
        Ok(match e {
            Expr::Const(value) | Expr::Text(value, _) => V::Ref(value),
            Expr::Var(name) => self.lookup(*name),
            Expr::Loop(attr) => {
                let state = self.loops.last().ok_or(Declined)?;
                let (i, n) = (state.index as i64, state.len as i64);
                match attr {
                    LoopAttr::Index0 => V::Own(Value::from(i)),
                    LoopAttr::Index => V::Own(Value::from(i + 1)),
                    LoopAttr::RevIndex0 => V::Own(Value::from(n - i - 1)),
                    LoopAttr::RevIndex => V::Own(Value::from(n - i)),
                    LoopAttr::First => V::bool(i == 0),
                    LoopAttr::Last => V::bool(i + 1 == n),
                    LoopAttr::Length => V::Own(Value::from(n)),
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
                let len = base.items().ok_or(Declined)?.len() as i64;
                let bound = |this: &mut Self, e: &'a Option<Box<Expr>>, default: i64| {
                    let Some(e) = e else { return Ok(default) };
                    let v = this.eval(e)?;
                    let v = v.value()?;
                    if v.is_none() {
                        return Ok(default);
                    }
                    let i = int(v).ok_or(Declined)?;
                    Ok(if i < 0 { (len + i).max(0) } else { i.min(len) })
                };
                let from = bound(self, start, 0)?;
                let to = bound(self, stop, len)?.max(from);
                let range = from as usize..to as usize;
                // minijinja's slice is a lazy iterable (not a sequence to
                // `is sequence`): modelled only as a view of borrowed items.
                V::Slice(&base.borrowed_items().ok_or(Declined)?[range])
            }
            Expr::Not(inner) => V::bool(!self.test(inner)?),
            Expr::Neg(inner) => {
                let v = self.eval(inner)?;
                let n = int(v.value()?).ok_or(Declined)?;
                V::Own(Value::from(n.checked_neg().ok_or(Declined)?))
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
                if let V::Slice(_) = v {
                    // An iterable: defined, and no sequence.
                    return Ok(V::bool(matches!(kind, TestKind::Defined)));
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
                let format = self.eval(format)?;
                let format = format.value()?.as_str().ok_or(Declined)?;
                V::Own(strftime_cached(format, (self.clock_seconds)()))
            }
            Expr::Method(base, method) => {
                let base = self.eval(base)?;
                let text = base.value()?;
                if text.kind() != ValueKind::String {
                    return Err(Declined);
                }
                let text = text.as_str().ok_or(Declined)?;
                match method {
                    Method::Strip => V::Own(Value::from(text.trim())),
                    Method::LStrip => V::Own(Value::from(text.trim_start())),
                    Method::RStrip => V::Own(Value::from(text.trim_end())),
                    Method::StartsWith(arg) | Method::EndsWith(arg) => {
                        let arg = self.eval(arg)?;
                        let arg = arg.value()?;
                        if arg.kind() != ValueKind::String {
                            return Err(Declined);
                        }
                        let affix = arg.as_str().ok_or(Declined)?;
                        V::bool(if matches!(method, Method::StartsWith(_)) {
                            text.starts_with(affix)
                        } else {
                            text.ends_with(affix)
                        })
                    }
                }
            }
            Expr::Decline => return Err(Declined),
        })
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
            return Err(Declined);
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
                value.get_attr(name).map(V::Own).map_err(|_| Declined)
            }
            V::Own(value) => {
                if let Some(found) = small_map_get(&value, name) {
                    return Ok(found.map_or_else(V::undefined, |v| V::Own(v.clone())));
                }
                value.get_attr(name).map(V::Own).map_err(|_| Declined)
            }
            V::Slice(_) => Err(Declined),
        }
    }

    fn item(&self, base: V<'a>, key: &Value) -> Step<V<'a>> {
        if let (V::Slice(_), Some(i)) = (&base, int(key))
            && i < 0
        {
            return Err(Declined);
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
            V::Ns(_) | V::Slice(_) => Err(Declined),
            other => other
                .value()?
                .get_item(key)
                .map(V::Own)
                .map_err(|_| Declined),
        }
    }

    fn filter(&mut self, kind: &'a FilterKind, v: V<'a>) -> Step<V<'a>> {
        if let V::Slice(list) = v {
            return match kind {
                FilterKind::Length => Ok(V::Own(Value::from(list.len() as i64))),
                FilterKind::Default(_) => Ok(v),
                _ => Err(Declined),
            };
        }
        let value = v.value()?;
        Ok(match kind {
            FilterKind::Trim => {
                if value.kind() != ValueKind::String {
                    return Err(Declined);
                }
                V::Own(Value::from(crate::template::python_strip(
                    value.as_str().ok_or(Declined)?,
                )))
            }
            FilterKind::Length => match value.kind() {
                ValueKind::String => V::Own(Value::from(
                    value.as_str().ok_or(Declined)?.chars().count() as i64,
                )),
                ValueKind::Seq | ValueKind::Map => {
                    V::Own(Value::from(value.len().ok_or(Declined)? as i64))
                }
                _ => return Err(Declined),
            },
            FilterKind::Safe => {
                if value.kind() != ValueKind::String {
                    return Err(Declined);
                }
                V::Own(Value::from_safe_string(
                    value.as_str().ok_or(Declined)?.to_owned(),
                ))
            }
            FilterKind::ToJson(options) => {
                let text = json_text(value, options).map_err(|_| Declined)?;
                V::Own(Value::from_safe_string(text))
            }
            FilterKind::Default(fallback) => {
                if value.is_undefined() {
                    self.eval(fallback)?
                } else {
                    v
                }
            }
        })
    }
}

/// `left op right` as minijinja decides it, for the operand kinds where
/// that is plain; declines on the rest.
fn compare(left: &Value, op: Cmp, right: &Value) -> Step<bool> {
    Ok(match op {
        Cmp::Eq => left == right,
        Cmp::Ne => left != right,
        Cmp::Lt | Cmp::Lte | Cmp::Gt | Cmp::Gte => {
            let (l, r) = (int(left).ok_or(Declined)?, int(right).ok_or(Declined)?);
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
    if let Some(list) = items(container) {
        return Ok(list.iter().any(|x| x == item));
    }
    if container.kind() == ValueKind::String && item.kind() == ValueKind::String {
        let (haystack, needle) = (
            container.as_str().ok_or(Declined)?,
            item.as_str().ok_or(Declined)?,
        );
        return Ok(haystack.contains(needle));
    }
    if let Some(entries) = small_map_entries(container) {
        return Ok(entries.iter().any(|(k, _)| k == item));
    }
    Err(Declined)
}
