//! The compiler from minijinja's syntax tree to the program of [`super::tree`].

use minijinja::machinery::ast;
use minijinja::value::{Value, ValueKind};

use super::Name;
use super::tree::{
    Arith, Cmp, Expr, FilterKind, ForLoop, LoopAttr, MacroDef, Method, Side, Stmt, TestKind,
};
use crate::tojson::JsonOptions;

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

/// Names assigned outside macro bodies (`set`, loop targets, `with`,
/// block sets): a macro that reads one would see minijinja's closure of
/// it, which this module does not model.
pub(super) fn collect_assigned<'s>(stmts: &[ast::Stmt<'s>], into: &mut Vec<&'s str>) {
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

/// How a variable is read where it is named (see `Compiler::reading`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// The innermost frames that bind it, then the context.
    Plain,
    /// From the enclosing macro's closure: the top level's frame, then
    /// the context.
    Closure,
    /// Left to minijinja.
    No,
}

#[derive(Default, Clone)]
pub(super) struct Scope {
    /// Inside a macro body: its parameters, and the targets of the loops
    /// (within the macro) around the node: names bound in the macro's
    /// own frames wherever they are read here.
    macro_locals: Option<Vec<String>>,
    /// Inside a macro body: every name the body assigns (`set`, loop
    /// targets, block `set`s). One of them read where it may be unbound
    /// is left to minijinja: its fallback there is the macro's closure
    /// or the context, depending on when the top level stored it.
    macro_assigned: Vec<String>,
    /// How many `for` loops enclose the node, within the macro or the
    /// top level.
    loop_depth: usize,
    /// Set when a `loop.*` attribute of the innermost loop is compiled.
    loop_used: bool,
    /// Set when one of them needs the loop's length (`length`, `last`,
    /// `revindex`, `revindex0`).
    loop_len_used: bool,
    /// Inside a block `set` (in this loop body): `break` and `continue`
    /// there are left to minijinja, whose capture they would leave open.
    in_set_block: bool,
}

pub(super) struct Compiler<'s> {
    pub(super) names: Vec<Box<str>>,
    pub(super) macros: Vec<MacroDef>,
    pub(super) macro_names: Vec<&'s str>,
    /// Every macro the template defines at its top level, in order, with
    /// its parameters' names: a macro's index is its place here.
    pub(super) top_macros: Vec<(&'s str, Vec<&'s str>)>,
    pub(super) assigned_outside_macros: Vec<&'s str>,
    pub(super) called_builtins: Vec<Name>,
    /// Every namespace attribute the template names (`namespace(a=...)`,
    /// `set ns.a = ...`), once each: the render memo stores attribute
    /// names as text and finds them here again.
    pub(super) ns_fields: Vec<Box<str>>,
    pub(super) scope: Scope,
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

    fn ns_field(&mut self, field: &str) {
        if !self.ns_fields.iter().any(|f| **f == *field) {
            self.ns_fields.push(field.into());
        }
    }

    fn is_macro(&self, id: &str) -> Option<usize> {
        self.macro_names.iter().position(|n| *n == id)
    }

    /// A macro the template defines later at its top level, named inside
    /// a macro body where no local shadows it: minijinja's closure of the
    /// macro being compiled takes the name once the later macro is
    /// defined (its store at the top level), so a call finds it if the
    /// definition has run by then (checked when rendering).
    fn later_macro(&self, id: &str) -> Option<usize> {
        let locals = self.scope.macro_locals.as_ref()?;
        if locals.iter().any(|l| l == id) || self.scope.macro_assigned.iter().any(|a| a == id) {
            return None;
        }
        let at = self.top_macros.iter().position(|(n, _)| *n == id)?;
        (at >= self.macro_names.len()).then_some(at)
    }

    /// A list of statements. Inside a macro, each name a statement of the
    /// list sets (`set x = ...`, a block `set`) is bound, in the frame the
    /// list runs in (the macro's or a loop's), for the statements after it
    /// in the list, wherever they read it (loops and conditionals inside
    /// see that frame); past the list's end it may be unbound.
    pub(super) fn block(
        &mut self,
        stmts: &[ast::Stmt<'s>],
        top: bool,
    ) -> Result<Vec<Stmt>, String> {
        let bound_before = self.scope.macro_locals.as_ref().map(Vec::len);
        let mut out = Vec::with_capacity(stmts.len());
        for stmt in stmts {
            let compiled = self.stmt(stmt, top);
            let compiled = match compiled {
                Ok(compiled) => compiled,
                Err(e) => {
                    self.unbind_to(bound_before);
                    return Err(e);
                }
            };
            out.push(compiled);
            let target = match stmt {
                ast::Stmt::Set(s) => &s.target,
                ast::Stmt::SetBlock(s) => &s.target,
                _ => continue,
            };
            if let ast::Expr::Var(v) = target
                && let Some(locals) = &mut self.scope.macro_locals
                && !locals.iter().any(|l| l == v.id)
            {
                locals.push(v.id.to_owned());
            }
        }
        self.unbind_to(bound_before);
        Ok(out)
    }

    /// Forgets the names bound inside a macro since it had `len` of them.
    fn unbind_to(&mut self, len: Option<usize>) {
        if let (Some(locals), Some(len)) = (&mut self.scope.macro_locals, len) {
            locals.truncate(len);
        }
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
                        return Ok(decline_stmt(format!("`set` of `{}`", v.id)));
                    }
                    let value = self.expr(&s.expr)?;
                    Stmt::Set(self.name(v.id)?, value)
                }
                ast::Expr::GetAttr(a) => match &a.expr {
                    ast::Expr::Var(v) if self.reading(v.id) != Reading::No => {
                        self.ns_field(a.name);
                        let from_closure = self.reading(v.id) == Reading::Closure;
                        Stmt::SetAttr {
                            name: self.name(v.id)?,
                            from_closure,
                            attr: a.name.into(),
                            value: self.expr(&s.expr)?,
                        }
                    }
                    _ => decline_stmt("`set` of an attribute of an expression"),
                },
                _ => decline_stmt("`set` of several targets"),
            },
            ast::Stmt::SetBlock(s) => match (&s.target, &s.filter) {
                (ast::Expr::Var(v), None) => {
                    if self.is_macro(v.id).is_some() || v.id == "loop" {
                        return Err(format!("`set` of `{}`", v.id));
                    }
                    if is_builtin(v.id) {
                        return Ok(decline_stmt(format!("`set` of `{}`", v.id)));
                    }
                    // minijinja runs the body in the enclosing scope.
                    let outer = std::mem::replace(&mut self.scope.in_set_block, true);
                    let body = self.block(&s.body, false);
                    self.scope.in_set_block = outer;
                    let body = body?;
                    Stmt::SetBlock(self.name(v.id)?, body)
                }
                _ => decline_stmt("a block `set` with a filter or several targets"),
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
                    // A parameter may shadow `namespace` (its calls in the
                    // body then decline); the other functions, not.
                    if is_builtin(v.id) && v.id != "namespace" {
                        return Err(format!("macro `{}` has a parameter `{}`", m.name, v.id));
                    }
                    params.push(self.name(v.id)?);
                    locals.push(v.id.to_owned());
                }
                // Constant defaults only: minijinja evaluates a default
                // inside the macro's frame, where another parameter may
                // already be bound; a constant cannot see it.
                let mut defaults = vec![None; params.len()];
                let first = params.len().saturating_sub(m.defaults.len());
                let mut constant = m.defaults.len() <= params.len();
                for (slot, default) in defaults[first..].iter_mut().zip(&m.defaults) {
                    *slot = default.as_const();
                    constant &= slot.is_some();
                }
                // Registered before its body is compiled: a macro may call
                // itself (minijinja's closure sees the name once defined);
                // MAX_MACRO_DEPTH bounds the recursion.
                let index = self.macros.len();
                self.macro_names.push(m.name);
                self.macros.push(MacroDef {
                    params,
                    defaults,
                    body: Vec::new(),
                });
                let body = if constant {
                    let mut assigned = Vec::new();
                    collect_assigned(&m.body, &mut assigned);
                    let outer = std::mem::replace(
                        &mut self.scope,
                        Scope {
                            macro_locals: Some(locals),
                            macro_assigned: assigned.into_iter().map(str::to_owned).collect(),
                            ..Scope::default()
                        },
                    );
                    let body = self.block(&m.body, false);
                    self.scope = outer;
                    body?
                } else {
                    vec![decline_stmt(format!(
                        "macro `{}` with a default that is not a constant",
                        m.name
                    ))]
                };
                self.macros[index].body = body;
                Stmt::DefineMacro
            }
            ast::Stmt::Extends(_)
            | ast::Stmt::Block(_)
            | ast::Stmt::Include(_)
            | ast::Stmt::Import(_)
            | ast::Stmt::FromImport(_)
            | ast::Stmt::AutoEscape(_) => {
                return Err("template inheritance, includes, imports or autoescape".into());
            }
            ast::Stmt::Break(_) | ast::Stmt::Continue(_)
                if self.scope.loop_depth > 0 && !self.scope.in_set_block =>
            {
                if matches!(stmt, ast::Stmt::Break(_)) {
                    Stmt::Break
                } else {
                    Stmt::Continue
                }
            }
            other => decline_stmt(statement_name(other)),
        })
    }

    fn for_loop(&mut self, f: &ast::ForLoop<'s>) -> Result<Stmt, String> {
        // `for k, v in map.items()` / `map | items`: the pairs of a map.
        let (target, value_target, map) = match (&f.target, items_of(&f.iter)) {
            (ast::Expr::Var(target), _) => (target.id, None, None),
            (ast::Expr::List(l), Some(map)) => match l.items.as_slice() {
                [ast::Expr::Var(k), ast::Expr::Var(v)] if k.id != v.id => {
                    (k.id, Some(v.id), Some(map))
                }
                _ => return Ok(decline_stmt("`for` with several targets")),
            },
            _ => return Ok(decline_stmt("`for` with several targets")),
        };
        let sorted =
            map.is_some() && matches!(&f.iter, ast::Expr::Filter(s) if s.name == "dictsort");
        for id in std::iter::once(target).chain(value_target) {
            if f.recursive || id == "loop" || is_builtin(id) || self.is_macro(id).is_some() {
                return Ok(decline_stmt(format!(
                    "`for` with the target `{id}` or recursive"
                )));
            }
        }
        // `range(...)` as the loop's sequence: its integers, counted here.
        let mut range = None;
        if map.is_none()
            && let ast::Expr::Call(c) = &f.iter
            && let ast::CallType::Function("range") = c.identify_call()
            && (1..=3).contains(&c.args.len())
            && !self.assigned_outside_macros.contains(&"range")
            && let Some(args) = self.positional(&c.args)?
        {
            let id = self.name("range")?;
            self.called_builtins.push(id);
            range = Some(args);
        }
        // A loop over `selectattr(...)` reads the crate's generator: the
        // items that pass, of a length minijinja does not know.
        let mut generator = None;
        if map.is_none()
            && range.is_none()
            && let ast::Expr::Filter(inner) = &f.iter
        {
            generator = self.select_attr_eq(inner)?;
        }
        let unsized_iter = generator.is_some();
        // `seq[::-1]` is a lazy iterable in minijinja; as a loop's
        // sequence it is read last to first.
        let (iter, reversed) = match map.unwrap_or(&f.iter) {
            _ if range.is_some() => (Expr::Const(Value::from(())), false),
            _ if generator.is_some() => (generator.take().ok_or("no generator")?, false),
            ast::Expr::Slice(s)
                if s.start.is_none()
                    && s.stop.is_none()
                    && s.step
                        .as_ref()
                        .and_then(|e| e.as_const())
                        .and_then(|v| v.as_i64())
                        == Some(-1) =>
            {
                (self.expr(&s.expr)?, true)
            }
            other => (self.expr(other)?, false),
        };
        if map.is_some() && reversed {
            return Ok(decline_stmt("`for` over the items of `[::-1]`"));
        }
        let else_body = self.block(&f.else_body, false)?;
        let (target_id, value_target_id) = (target, value_target);
        let target = self.name(target)?;
        let value_target = value_target.map(|id| self.name(id)).transpose()?;
        let outer_used = self.scope.loop_used;
        let outer_len_used = self.scope.loop_len_used;
        let outer_in_set_block = std::mem::replace(&mut self.scope.in_set_block, false);
        self.scope.loop_depth += 1;
        self.scope.loop_used = false;
        self.scope.loop_len_used = false;
        // Inside a macro, the loop's targets are bound in its frame for
        // the filter and the body.
        let bound_before = self.scope.macro_locals.as_ref().map(Vec::len);
        if let Some(locals) = &mut self.scope.macro_locals {
            locals.extend(
                std::iter::once(target_id)
                    .chain(value_target_id)
                    .map(str::to_owned),
            );
        }
        let filter = f.filter_expr.as_ref().map(|e| self.expr(e)).transpose();
        let body = self.block(&f.body, false);
        if let (Some(locals), Some(len)) = (&mut self.scope.macro_locals, bound_before) {
            locals.truncate(len);
        }
        let used = self.scope.loop_used;
        let len_used = self.scope.loop_len_used;
        self.scope.loop_depth -= 1;
        self.scope.loop_used = outer_used;
        self.scope.loop_len_used = outer_len_used;
        self.scope.in_set_block = outer_in_set_block;
        let (filter, body) = (filter?, body?);
        if filter.is_some() && used {
            // `loop` over a filtered sequence counts the kept items only;
            // left to minijinja.
            return Ok(decline_stmt("`loop` in a filtered `for`"));
        }
        if (reversed || unsized_iter) && len_used {
            // An iterable's length is minijinja's to work out.
            return Ok(decline_stmt(
                "`loop.length` or `loop.last` over `[::-1]` or `selectattr`",
            ));
        }
        Ok(Stmt::For(Box::new(ForLoop {
            target,
            iter,
            filter,
            body,
            else_body,
            reversed,
            value_target,
            sorted,
            range,
        })))
    }

    /// Whether `id` is, inside a macro, one of its parameters or a name
    /// its body assigns.
    fn is_macro_local(&self, id: &str) -> bool {
        self.scope
            .macro_locals
            .as_ref()
            .is_some_and(|locals| locals.iter().any(|l| l == id))
            || self.scope.macro_assigned.iter().any(|a| a == id)
    }

    /// Whether a variable may be read here as a plain variable.
    fn readable(&self, id: &str) -> bool {
        self.reading(id) == Reading::Plain
    }

    /// How a variable is read here. Outside macros, and inside one for
    /// its parameters, the targets of its loops around the node and the
    /// names the template never assigns outside macros: plainly (its
    /// frames, then the context). A name the top level assigns and the
    /// macro never does: from the macro's closure. minijinja encloses
    /// such a name when it defines the macro and, the macro being defined
    /// at the top level, every later store of the top level's frame
    /// updates the closure, so the macro sees the top level's current
    /// value, else the context's (module `run`, `closure`). Anything else
    /// (a name both the macro and the top level assign, read where the
    /// macro may not have bound it) is left to minijinja.
    fn reading(&self, id: &str) -> Reading {
        let Some(locals) = &self.scope.macro_locals else {
            return Reading::Plain;
        };
        if locals.iter().any(|l| l == id) || !self.assigned_outside_macros.contains(&id) {
            Reading::Plain
        } else if !self.scope.macro_assigned.iter().any(|a| a == id) {
            Reading::Closure
        } else {
            Reading::No
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
                    || (id == "namespace" && !self.is_macro_local(id))
                    || id == "strftime_now"
                    || OTHER_GLOBALS.contains(&id)
                    || self.is_macro(id).is_some()
                    || (self.scope.macro_locals.is_some()
                        && self.top_macros.iter().any(|(n, _)| *n == id))
                    || self.reading(id) == Reading::No
                    || (self.scope.macro_locals.is_some() && MACRO_GLOBALS.contains(&id))
                {
                    decline(format!("the name `{id}` here"))
                } else if self.reading(id) == Reading::Closure {
                    Expr::Closure(self.name(id)?)
                } else {
                    Expr::Var(self.name(id)?)
                }
            }
            ast::Expr::Const(c) => Expr::Const(c.value.clone()),
            ast::Expr::Slice(s) => {
                if s.step.is_some() {
                    decline("a slice with a step")
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
                    ast::BinOpKind::Add => Expr::Add(left, right),
                    ast::BinOpKind::Sub => Expr::Arith(Arith::Sub, left, right),
                    ast::BinOpKind::Mul => decline("the operator `*`"),
                    ast::BinOpKind::Div => decline("the operator `/`"),
                    ast::BinOpKind::FloorDiv => decline("the operator `//`"),
                    ast::BinOpKind::Rem => Expr::Arith(Arith::Rem, left, right),
                    ast::BinOpKind::Pow => decline("the operator `**`"),
                }
            }
            ast::Expr::Compare(c) => {
                if c.ops.len() != 1 {
                    decline("a chained comparison")
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
                // `strftime_now is defined` (Llama 3.2): the function is
                // defined unless the context shadows it, which declines.
                if let ast::Expr::Var(v) = &t.expr
                    && v.id == "strftime_now"
                    && matches!(t.name, "defined" | "undefined")
                    && t.args.is_empty()
                    && self.readable(v.id)
                    && !self.assigned_outside_macros.contains(&v.id)
                {
                    let id = self.name(v.id)?;
                    self.called_builtins.push(id);
                    return Ok(Expr::Const(Value::from(t.name == "defined")));
                }
                let kind = match t.name {
                    "defined" => TestKind::Defined,
                    "undefined" => TestKind::Undefined,
                    "none" => TestKind::None,
                    "string" => TestKind::String,
                    "sequence" => TestKind::Sequence,
                    "mapping" => TestKind::Mapping,
                    "number" => TestKind::Number,
                    "boolean" => TestKind::Boolean,
                    "iterable" => TestKind::Iterable,
                    "true" => TestKind::True,
                    "false" => TestKind::False,
                    other => return Ok(decline(format!("the test `{other}`"))),
                };
                if !t.args.is_empty() {
                    return Ok(decline(format!("the test `{}` with arguments", t.name)));
                }
                Expr::Test(kind, self.boxed(&t.expr)?)
            }
            ast::Expr::GetAttr(a) => match &a.expr {
                ast::Expr::Var(v) if v.id == "loop" => {
                    if self.scope.loop_depth == 0 {
                        return Ok(decline("`loop` outside a loop"));
                    }
                    self.scope.loop_used = true;
                    if matches!(a.name, "length" | "last" | "revindex" | "revindex0") {
                        self.scope.loop_len_used = true;
                    }
                    match a.name {
                        "index0" => Expr::Loop(LoopAttr::Index0),
                        "index" => Expr::Loop(LoopAttr::Index),
                        "revindex0" => Expr::Loop(LoopAttr::RevIndex0),
                        "revindex" => Expr::Loop(LoopAttr::RevIndex),
                        "first" => Expr::Loop(LoopAttr::First),
                        "last" => Expr::Loop(LoopAttr::Last),
                        "length" => Expr::Loop(LoopAttr::Length),
                        "previtem" => Expr::Loop(LoopAttr::PrevItem),
                        "nextitem" => Expr::Loop(LoopAttr::NextItem),
                        other => decline(format!("`loop.{other}`")),
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
            ast::Expr::Map(m) => {
                let mut pairs = Vec::with_capacity(m.keys.len());
                for (key, value) in m.keys.iter().zip(&m.values) {
                    pairs.push((self.expr(key)?, self.expr(value)?));
                }
                Expr::Map(pairs)
            }
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
            return Ok(decline(format!(
                "the filter `{}` without an operand",
                f.name
            )));
        };
        let kind = match (f.name, f.args.as_slice()) {
            ("trim", []) => FilterKind::Trim,
            ("length" | "count", []) => FilterKind::Length,
            ("safe", []) => FilterKind::Safe,
            ("string", []) => FilterKind::String,
            ("join", []) => FilterKind::Join(None),
            ("join", [ast::CallArg::Pos(joiner)]) => FilterKind::Join(Some(self.boxed(joiner)?)),
            ("list", []) => {
                // The generator `selectattr` makes is read whole at once
                // by `list`: the items that pass, in order.
                if let ast::Expr::Filter(inner) = operand
                    && let Some(select) = self.select_attr_eq(inner)?
                {
                    return Ok(select);
                }
                FilterKind::List
            }
            ("default" | "d", [ast::CallArg::Pos(fallback)]) => {
                FilterKind::Default(self.boxed(fallback)?)
            }
            (
                "default" | "d",
                [
                    ast::CallArg::Pos(fallback),
                    ast::CallArg::Pos(ast::Expr::Const(lax)),
                ],
            ) if lax.value.kind() == ValueKind::Bool => {
                let fallback = self.boxed(fallback)?;
                if lax.value.is_true() {
                    FilterKind::DefaultFalsy(fallback)
                } else {
                    FilterKind::Default(fallback)
                }
            }
            ("upper", []) => FilterKind::Upper,
            ("min", []) => FilterKind::MinMax(false),
            ("max", []) => FilterKind::MinMax(true),
            ("int", []) => FilterKind::Int,
            ("lower", []) => FilterKind::Lower,
            ("replace", [ast::CallArg::Pos(old), ast::CallArg::Pos(new)]) => {
                FilterKind::Replace(self.boxed(old)?, self.boxed(new)?)
            }
            ("tojson", args) => match tojson_options(args) {
                Some(options) => FilterKind::ToJson(options),
                None => return Ok(decline("`tojson` with other arguments")),
            },
            (name, _) => return Ok(decline(format!("the filter `{name}`"))),
        };
        Ok(Expr::Filter(kind, self.boxed(operand)?))
    }

    /// `seq | selectattr(name, "equalto", value)` (a plain attribute
    /// name, the test `equalto`, `eq` or `==`) as the list of the items
    /// that pass; `None` for any other `selectattr`.
    fn select_attr_eq(&mut self, f: &ast::Filter<'s>) -> Result<Option<Expr>, String> {
        if f.name != "selectattr" {
            return Ok(None);
        }
        let Some(source) = &f.expr else {
            return Ok(None);
        };
        let [
            ast::CallArg::Pos(ast::Expr::Const(attr)),
            ast::CallArg::Pos(ast::Expr::Const(test)),
            ast::CallArg::Pos(value),
        ] = f.args.as_slice()
        else {
            return Ok(None);
        };
        let Some(attr) = attr.value.as_str() else {
            return Ok(None);
        };
        if attr.contains('.') || !matches!(test.value.as_str(), Some("equalto" | "eq" | "==")) {
            return Ok(None);
        }
        let kind = FilterKind::SelectAttrEq(attr.into(), self.boxed(value)?);
        Ok(Some(Expr::Filter(kind, self.boxed(source)?)))
    }

    /// A call of the top level's macro `index`: each argument with the
    /// parameter it binds, positional ones in order, keyword ones by name,
    /// as minijinja's macro binds them. Arguments minijinja refuses (too
    /// many, a keyword naming no parameter or one already given) decline.
    fn macro_call(
        &mut self,
        name: &str,
        index: usize,
        args: &[ast::CallArg<'s>],
    ) -> Result<Expr, String> {
        let params = self
            .top_macros
            .get(index)
            .map(|(_, params)| params.clone())
            .ok_or("a macro outside the top level's")?;
        let mut bound = Vec::with_capacity(args.len());
        let mut taken = vec![false; params.len()];
        for (at, arg) in args.iter().enumerate() {
            let (slot, value) = match arg {
                ast::CallArg::Pos(value) => (at, value),
                ast::CallArg::Kwarg(key, value) => {
                    let Some(slot) = params.iter().position(|p| p == key) else {
                        return Ok(decline(format!("macro `{name}` with an unknown keyword")));
                    };
                    (slot, value)
                }
                _ => {
                    return Ok(decline(format!("macro `{name}` with spread arguments")));
                }
            };
            match taken.get_mut(slot) {
                Some(slot_taken) if !*slot_taken => *slot_taken = true,
                Some(_) => {
                    return Ok(decline(format!("macro `{name}` with a duplicate argument")));
                }
                None => return Ok(decline(format!("macro `{name}` with extra arguments"))),
            }
            bound.push((slot, self.expr(value)?));
        }
        Ok(Expr::CallMacro(index, bound))
    }

    fn call(&mut self, c: &ast::Call<'s>) -> Result<Expr, String> {
        match c.identify_call() {
            ast::CallType::Function(name) => {
                if self.is_macro_local(name) {
                    // A parameter or a local of the macro shadows any
                    // function or macro of that name.
                    return Ok(decline(format!("a call of the local `{name}`")));
                }
                if let Some(index) = self.is_macro(name).or_else(|| self.later_macro(name)) {
                    return self.macro_call(name, index, &c.args);
                }
                if self.assigned_outside_macros.contains(&name) {
                    return Ok(decline(format!("a call of the variable `{name}`")));
                }
                match name {
                    "namespace" => {
                        let mut fields = Vec::with_capacity(c.args.len());
                        for arg in &c.args {
                            let ast::CallArg::Kwarg(key, value) = arg else {
                                return Ok(decline("`namespace` with positional arguments"));
                            };
                            self.ns_field(key);
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
                        _ => Ok(decline("`strftime_now` with other arguments")),
                    },
                    other => Ok(decline(format!("a call of `{other}`"))),
                }
            }
            ast::CallType::Method(base, name) => {
                let Some(mut args) = self.positional(&c.args)? else {
                    return Ok(decline(format!(
                        "the method `{name}` with keyword arguments"
                    )));
                };
                let method = match (name, args.len()) {
                    ("strip", 0) => Method::Strip,
                    ("lstrip", 0) => Method::LStrip,
                    ("rstrip", 0) => Method::RStrip,
                    ("startswith", 1) => Method::StartsWith(Box::new(args.remove(0))),
                    ("endswith", 1) => Method::EndsWith(Box::new(args.remove(0))),
                    ("strip", 1) => Method::StripChars(Side::Both, Box::new(args.remove(0))),
                    ("lstrip", 1) => Method::StripChars(Side::Start, Box::new(args.remove(0))),
                    ("rstrip", 1) => Method::StripChars(Side::End, Box::new(args.remove(0))),
                    ("split", 0..=2) => {
                        let mut args = args.into_iter().map(Box::new);
                        Method::Split(args.next(), args.next())
                    }
                    ("replace", 2) => {
                        let new = Box::new(args.remove(1));
                        Method::Replace(Box::new(args.remove(0)), new)
                    }
                    ("format", _) => Method::Format(std::mem::take(&mut args)),
                    ("get", 1..=2) => {
                        let mut args = args.into_iter().map(Box::new);
                        let key = args.next().ok_or("a `get` without its key")?;
                        Method::Get(key, args.next())
                    }
                    (other, n) => {
                        return Ok(decline(format!("the method `{other}` with {n} arguments")));
                    }
                };
                Ok(Expr::Method(self.boxed(base)?, method))
            }
            _ => Ok(decline("a call of an expression")),
        }
    }
}

/// The map of `map.items()`, `map | items` or `map | dictsort` (no
/// arguments).
fn items_of<'a, 's>(iter: &'a ast::Expr<'s>) -> Option<&'a ast::Expr<'s>> {
    match iter {
        ast::Expr::Call(c) if c.args.is_empty() => match c.identify_call() {
            ast::CallType::Method(base, "items") => Some(base),
            _ => None,
        },
        ast::Expr::Filter(f) if matches!(f.name, "items" | "dictsort") && f.args.is_empty() => {
            f.expr.as_ref()
        }
        _ => None,
    }
}

/// A node that declines when reached, naming `what` for diagnostics.
fn decline(what: impl Into<String>) -> Expr {
    Expr::Decline(what.into().into_boxed_str())
}

/// A statement that declines when reached, naming `what`.
fn decline_stmt(what: impl Into<String>) -> Stmt {
    Stmt::Decline(what.into().into_boxed_str())
}

/// A statement's kind, as the template spells it, for a decline reason.
fn statement_name(stmt: &ast::Stmt<'_>) -> &'static str {
    match stmt {
        ast::Stmt::WithBlock(_) => "`with`",
        ast::Stmt::SetBlock(_) => "a block `set`",
        ast::Stmt::FilterBlock(_) => "a `filter` block",
        ast::Stmt::CallBlock(_) => "a `call` block",
        ast::Stmt::Do(_) => "`do`",
        _ => "a statement (`break`, `continue` or another)",
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
