//! jinja2's `Markup` concatenation: `+` beside a safe string escapes.
//!
//! In jinja2, `text | safe` is a markupsafe `Markup`, and `Markup + str`
//! (`Markup.__add__`) and `str + Markup` (`Markup.__radd__`, which Python
//! tries first because `Markup` subclasses `str`) HTML-escape the plain
//! operand and return `Markup` again: every plain string later added in
//! the chain is escaped too. transformers renders chat templates without
//! autoescape, so this is the one place a chat template meets escaping
//! (functionary v3.1 writes its tool list with `"..." | safe + name`).
//! minijinja's `+` joins two strings into a plain one, whatever their
//! safety, and has no operator hook.
//!
//! # How
//!
//! At load, [`rewrite_adds`] finds each `+` of the template that can have
//! a `Markup` operand, from minijinja's syntax tree, and rewrites it into
//! the filter [`MARKUP_ADD`]: `LEFT + RIGHT` becomes
//! `(LEFT) | __markup_add(RIGHT)`, every other byte of the template kept
//! (whitespace control, line breaks, the other expressions). A filter,
//! not a function, because a context variable or a `set` can shadow a
//! function's name in minijinja but never a filter's. An operand can be
//! `Markup` when it is
//!
//! - an expression whose last filter is `safe`, `escape`/`e` or
//!   `forceescape` (each returns `Markup` in jinja2),
//! - another such `+` (a chain), a conditional expression either of whose
//!   branches can be, or a parenthesised form of these,
//! - a variable or a namespace attribute (`ns.x`) that the template
//!   assigns somewhere (`set`, `with`, a block `set` whose filter ends in
//!   `safe` or `escape`) from such an expression, found by a fixed point
//!   over the template's assignments, regardless of scope.
//!
//! The analysis may flag a `+` whose operands turn out plain: the filter
//! then hands both to minijinja's own `+` (see [`markup_add`]), so such a
//! rewrite changes nothing. A template with no such `+` is compiled as
//! written.
//!
//! # What it does not follow
//!
//! `Markup` that flows through a filter or method other than those above
//! (`x | safe | trim`, `(x | safe).strip()`, `(x | safe)[1:]`, `x | safe *
//! 2`), or through a loop variable, a macro argument or a list: jinja2
//! keeps it `Markup` there and minijinja mostly does not, so such a `+`
//! would be joined without escaping. No template of the corpus does it.

use std::borrow::Cow;
use std::sync::LazyLock;

use minijinja::machinery::ast;
use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, ErrorKind};

use crate::Error;

/// The filter [`rewrite_adds`] turns a `+` beside `Markup` into.
pub(crate) const MARKUP_ADD: &str = "__markup_add";

/// The filters whose result is jinja2's `Markup` (jinja2 3.1.6's
/// `do_mark_safe`, `escape`, `do_forceescape`).
const MARKUP_FILTERS: &[&str] = &["safe", "escape", "e", "forceescape"];

/// markupsafe's `escape` of a plain string (its `_escape_inner`: `&`,
/// `>`, `<`, `'` and `"`, with those entities).
pub(crate) fn escape_html(text: &str) -> Cow<'_, str> {
    if !text.contains(['&', '<', '>', '\'', '"']) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\'' => out.push_str("&#39;"),
            '"' => out.push_str("&#34;"),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Python's `str()` of `value`, as jinja2's filters convert a
/// non-string (an undefined value is the empty string).
fn python_text(value: &Value) -> String {
    if value.is_undefined() {
        return String::new();
    }
    match value.as_str() {
        Some(text) if value.kind() == ValueKind::String => text.to_owned(),
        _ => crate::pyrepr::python_str(value).unwrap_or_else(|| value.to_string()),
    }
}

/// jinja2's `escape` (alias `e`), markupsafe's `escape`: a safe string
/// is returned as it is, any other value is converted with Python's
/// `str()` and escaped with markupsafe's table (minijinja's own filter
/// writes other entities: `&quot;`, `&#x27;`, `&#x2f;`); the result is
/// safe.
pub(crate) fn escape(value: Value) -> Value {
    if value.is_safe() {
        return value;
    }
    Value::from_safe_string(escape_html(&python_text(&value)).into_owned())
}

/// jinja2's `forceescape`: like [`escape`], but a safe string's text is
/// escaped again.
pub(crate) fn forceescape(value: Value) -> Value {
    Value::from_safe_string(escape_html(&python_text(&value)).into_owned())
}

/// The filter [`MARKUP_ADD`]: `lhs + rhs` as jinja2 computes it.
///
/// When either operand is a safe string (jinja2's `Markup`), the plain
/// string operand is escaped with markupsafe's table and the result is a
/// safe string; an operand that is neither a string nor safe is refused
/// as Python refuses it (`TypeError: unsupported operand type(s) for +`;
/// an undefined value raises jinja2's `UndefinedError`). Otherwise it is
/// minijinja's own `+`, unchanged: the same numbers, overflow, sequences
/// and errors.
pub(crate) fn markup_add(lhs: Value, rhs: Value) -> Result<Value, minijinja::Error> {
    let (left_safe, right_safe) = (lhs.is_safe(), rhs.is_safe());
    if !left_safe && !right_safe {
        return plain_add(lhs, rhs);
    }
    // A safe value is always a string.
    let operand = |value: &Value| -> Result<String, minijinja::Error> {
        if value.is_safe() {
            return Ok(value.as_str().unwrap_or_default().to_owned());
        }
        match value.as_str() {
            Some(text) if value.kind() == ValueKind::String => Ok(escape_html(text).into_owned()),
            _ => Err(refused(&lhs, &rhs)),
        }
    };
    let mut joined = operand(&lhs)?;
    joined.push_str(&operand(&rhs)?);
    Ok(Value::from_safe_string(joined))
}

/// Python's error for `lhs + rhs` with a `Markup` operand and one that is
/// neither a string nor `Markup`.
fn refused(lhs: &Value, rhs: &Value) -> minijinja::Error {
    if lhs.is_undefined() || rhs.is_undefined() {
        return minijinja::Error::new(
            ErrorKind::UndefinedError,
            "an undefined value cannot be added to a Markup string",
        );
    }
    if lhs.kind() == ValueKind::Seq {
        // list.__add__ raises before Markup.__radd__ is asked.
        return minijinja::Error::new(
            ErrorKind::InvalidOperation,
            "can only concatenate list (not \"Markup\") to list",
        );
    }
    minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "unsupported operand type(s) for +: '{}' and '{}'",
            python_type(lhs),
            python_type(rhs)
        ),
    )
}

/// The name of `value`'s type in Python, as jinja2 would hold it.
fn python_type(value: &Value) -> &'static str {
    if value.is_safe() {
        return "Markup";
    }
    match value.kind() {
        ValueKind::Undefined => "Undefined",
        ValueKind::None => "NoneType",
        ValueKind::Bool => "bool",
        ValueKind::Number if value.is_integer() => "int",
        ValueKind::Number => "float",
        ValueKind::String => "str",
        ValueKind::Bytes => "bytes",
        ValueKind::Seq => "list",
        ValueKind::Map => "dict",
        ValueKind::Iterable => "generator",
        ValueKind::Plain => "object",
        ValueKind::Invalid => "invalid",
        _ => "object",
    }
}

/// An environment with nothing but minijinja's defaults, and `a + b`
/// compiled in it: minijinja's `+` (its `ops::add`, which the crate does
/// not export) is the VM's `Add` instruction, the same in every
/// environment.
static PLAIN_ENV: LazyLock<Environment<'static>> = LazyLock::new(Environment::new);

/// minijinja's `lhs + rhs`, evaluated by minijinja itself so that it
/// cannot drift from the `+` of the templates that are not rewritten.
fn plain_add(lhs: Value, rhs: Value) -> Result<Value, minijinja::Error> {
    static ADD: LazyLock<Result<minijinja::Expression<'static, 'static>, minijinja::Error>> =
        LazyLock::new(|| PLAIN_ENV.compile_expression("a + b"));
    match &*ADD {
        Ok(add) => add.eval(minijinja::context! { a => lhs, b => rhs }),
        Err(err) => Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("minijinja's `+` could not be compiled: {err}"),
        )),
    }
}

/// What a name or a namespace attribute is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Target<'s> {
    Name(&'s str),
    Attr(&'s str, &'s str),
}

impl<'s> Target<'s> {
    fn of(expr: &ast::Expr<'s>) -> Option<Self> {
        match expr {
            ast::Expr::Var(v) => Some(Target::Name(v.id)),
            ast::Expr::GetAttr(a) => match &a.expr {
                ast::Expr::Var(base) => Some(Target::Attr(base.id, a.name)),
                _ => None,
            },
            _ => None,
        }
    }
}

/// The template's assignments and Markup-holding names.
#[derive(Default)]
struct Analysis<'a, 's> {
    /// `set` and `with` assignments: target and value.
    assigned: Vec<(Target<'s>, &'a ast::Expr<'s>)>,
    /// Targets that hold Markup.
    markup: Vec<Target<'s>>,
}

impl<'a, 's> Analysis<'a, 's> {
    fn of(tree: &'a ast::Stmt<'s>) -> Self {
        let mut analysis = Self::default();
        analysis.stmt(tree);
        // Each round marks at least one more target or ends.
        loop {
            let before = analysis.markup.len();
            for i in 0..analysis.assigned.len() {
                let (target, value) = analysis.assigned[i];
                if !analysis.markup.contains(&target) && analysis.is_markup(value) {
                    analysis.markup.push(target);
                }
            }
            if analysis.markup.len() == before {
                return analysis;
            }
        }
    }

    fn stmt(&mut self, stmt: &'a ast::Stmt<'s>) {
        for_each_child(stmt, &mut |child| match child {
            Child::Stmt(s) => self.stmt(s),
            Child::Expr(_) => {}
        });
        match stmt {
            ast::Stmt::Set(s) => {
                if let Some(target) = Target::of(&s.target) {
                    self.assigned.push((target, &s.expr));
                }
            }
            ast::Stmt::WithBlock(w) => {
                for (target, value) in &w.assignments {
                    if let Some(target) = Target::of(target) {
                        self.assigned.push((target, value));
                    }
                }
            }
            ast::Stmt::SetBlock(s) => {
                let last_filter = match &s.filter {
                    Some(ast::Expr::Filter(f)) => Some(f.name),
                    _ => None,
                };
                if let (Some(target), Some(name)) = (Target::of(&s.target), last_filter)
                    && MARKUP_FILTERS.contains(&name)
                    && !self.markup.contains(&target)
                {
                    self.markup.push(target);
                }
            }
            _ => {}
        }
    }

    /// Whether `expr` can evaluate to Markup (see the module docs).
    fn is_markup(&self, expr: &ast::Expr<'s>) -> bool {
        match expr {
            ast::Expr::Filter(f) => MARKUP_FILTERS.contains(&f.name) || f.name == MARKUP_ADD,
            ast::Expr::BinOp(b) => {
                matches!(b.op, ast::BinOpKind::Add)
                    && (self.is_markup(&b.left) || self.is_markup(&b.right))
            }
            ast::Expr::IfExpr(i) => {
                self.is_markup(&i.true_expr)
                    || i.false_expr.as_ref().is_some_and(|e| self.is_markup(e))
            }
            ast::Expr::Var(_) | ast::Expr::GetAttr(_) => {
                Target::of(expr).is_some_and(|target| self.markup.contains(&target))
            }
            _ => false,
        }
    }

    /// Every `+` of `stmt` (and below) that can have a Markup operand.
    fn adds(&self, stmt: &'a ast::Stmt<'s>, out: &mut Vec<&'a ast::Spanned<ast::BinOp<'s>>>) {
        for_each_child(stmt, &mut |child| match child {
            Child::Stmt(s) => self.adds(s, out),
            Child::Expr(e) => self.expr_adds(e, out),
        });
    }

    fn expr_adds(&self, expr: &'a ast::Expr<'s>, out: &mut Vec<&'a ast::Spanned<ast::BinOp<'s>>>) {
        if let ast::Expr::BinOp(b) = expr
            && matches!(b.op, ast::BinOpKind::Add)
            && (self.is_markup(&b.left) || self.is_markup(&b.right))
        {
            out.push(b);
        }
        for_each_subexpr(expr, &mut |sub| self.expr_adds(sub, out));
    }
}

/// A statement's direct children.
enum Child<'a, 's> {
    Stmt(&'a ast::Stmt<'s>),
    Expr(&'a ast::Expr<'s>),
}

/// Calls `f` on each statement directly in `stmt`'s bodies and each
/// expression `stmt` itself holds.
fn for_each_child<'a, 's>(stmt: &'a ast::Stmt<'s>, f: &mut dyn FnMut(Child<'a, 's>)) {
    let stmts = |f: &mut dyn FnMut(Child<'a, 's>), list: &'a [ast::Stmt<'s>]| {
        list.iter().for_each(|s| f(Child::Stmt(s)));
    };
    let args = |f: &mut dyn FnMut(Child<'a, 's>), call: &'a ast::Call<'s>| {
        f(Child::Expr(&call.expr));
        call_args(&call.args, &mut |e| f(Child::Expr(e)));
    };
    match stmt {
        ast::Stmt::Template(t) => stmts(f, &t.children),
        ast::Stmt::EmitExpr(e) => f(Child::Expr(&e.expr)),
        ast::Stmt::EmitRaw(_) | ast::Stmt::Continue(_) | ast::Stmt::Break(_) => {}
        ast::Stmt::ForLoop(l) => {
            f(Child::Expr(&l.target));
            f(Child::Expr(&l.iter));
            if let Some(filter) = &l.filter_expr {
                f(Child::Expr(filter));
            }
            stmts(f, &l.body);
            stmts(f, &l.else_body);
        }
        ast::Stmt::IfCond(i) => {
            f(Child::Expr(&i.expr));
            stmts(f, &i.true_body);
            stmts(f, &i.false_body);
        }
        ast::Stmt::WithBlock(w) => {
            for (target, value) in &w.assignments {
                f(Child::Expr(target));
                f(Child::Expr(value));
            }
            stmts(f, &w.body);
        }
        ast::Stmt::Set(s) => {
            f(Child::Expr(&s.target));
            f(Child::Expr(&s.expr));
        }
        ast::Stmt::SetBlock(s) => {
            f(Child::Expr(&s.target));
            if let Some(filter) = &s.filter {
                f(Child::Expr(filter));
            }
            stmts(f, &s.body);
        }
        ast::Stmt::AutoEscape(a) => {
            f(Child::Expr(&a.enabled));
            stmts(f, &a.body);
        }
        ast::Stmt::FilterBlock(b) => {
            f(Child::Expr(&b.filter));
            stmts(f, &b.body);
        }
        ast::Stmt::Block(b) => stmts(f, &b.body),
        ast::Stmt::Import(i) => {
            f(Child::Expr(&i.expr));
            f(Child::Expr(&i.name));
        }
        ast::Stmt::FromImport(i) => f(Child::Expr(&i.expr)),
        ast::Stmt::Extends(e) => f(Child::Expr(&e.name)),
        ast::Stmt::Include(i) => f(Child::Expr(&i.name)),
        ast::Stmt::Macro(m) => {
            m.args.iter().for_each(|a| f(Child::Expr(a)));
            m.defaults.iter().for_each(|d| f(Child::Expr(d)));
            stmts(f, &m.body);
        }
        ast::Stmt::CallBlock(c) => {
            args(f, &c.call);
            c.macro_decl.args.iter().for_each(|a| f(Child::Expr(a)));
            c.macro_decl.defaults.iter().for_each(|d| f(Child::Expr(d)));
            stmts(f, &c.macro_decl.body);
        }
        ast::Stmt::Do(d) => args(f, &d.call),
    }
}

fn call_args<'a, 's>(args: &'a [ast::CallArg<'s>], f: &mut dyn FnMut(&'a ast::Expr<'s>)) {
    for arg in args {
        match arg {
            ast::CallArg::Pos(e)
            | ast::CallArg::Kwarg(_, e)
            | ast::CallArg::PosSplat(e)
            | ast::CallArg::KwargSplat(e) => f(e),
        }
    }
}

/// Calls `f` on each direct subexpression of `expr`.
fn for_each_subexpr<'a, 's>(expr: &'a ast::Expr<'s>, f: &mut dyn FnMut(&'a ast::Expr<'s>)) {
    match expr {
        ast::Expr::Var(_) | ast::Expr::Const(_) => {}
        ast::Expr::Slice(s) => {
            f(&s.expr);
            for part in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                f(part);
            }
        }
        ast::Expr::UnaryOp(u) => f(&u.expr),
        ast::Expr::BinOp(b) => {
            f(&b.left);
            f(&b.right);
        }
        ast::Expr::Compare(c) => {
            f(&c.expr);
            c.ops.iter().for_each(|op| f(&op.expr));
        }
        ast::Expr::IfExpr(i) => {
            f(&i.test_expr);
            f(&i.true_expr);
            if let Some(otherwise) = &i.false_expr {
                f(otherwise);
            }
        }
        ast::Expr::Filter(x) => {
            if let Some(inner) = &x.expr {
                f(inner);
            }
            call_args(&x.args, f);
        }
        ast::Expr::Test(t) => {
            f(&t.expr);
            call_args(&t.args, f);
        }
        ast::Expr::GetAttr(g) => f(&g.expr),
        ast::Expr::GetItem(g) => {
            f(&g.expr);
            f(&g.subscript_expr);
        }
        ast::Expr::Call(c) => {
            f(&c.expr);
            call_args(&c.args, f);
        }
        ast::Expr::List(l) => l.items.iter().for_each(&mut *f),
        ast::Expr::Map(m) => {
            m.keys.iter().for_each(&mut *f);
            m.values.iter().for_each(&mut *f);
        }
    }
}

/// The `+` expressions of `tree` to rewrite, with the Markup analysis.
fn markup_adds<'a, 's>(tree: &'a ast::Stmt<'s>) -> Vec<&'a ast::Spanned<ast::BinOp<'s>>> {
    let analysis = Analysis::of(tree);
    let mut adds = Vec::new();
    analysis.adds(tree, &mut adds);
    adds
}

/// One change to the source: `insert` at byte `at`, in place of `len`
/// bytes there.
struct Edit {
    at: usize,
    len: usize,
    insert: &'static str,
}

/// `source` with each `+` that can have a Markup operand rewritten into
/// [`MARKUP_ADD`] (see the module docs); borrowed unchanged when there is
/// none, or when the source does not parse (compiling it reports that).
/// The rewrite is checked by parsing its result: a template it could not
/// rewrite exactly is refused with the line of the `+`
/// ([`Error::TemplateUnsupported`]) rather than rendered without the
/// escaping.
pub(crate) fn rewrite_adds(source: &str) -> Result<Cow<'_, str>, Error> {
    // A template without `+` has nothing to rewrite (most have one).
    if !source.contains('+') {
        return Ok(Cow::Borrowed(source));
    }
    let Ok(tree) = crate::support::parse_template(source) else {
        return Ok(Cow::Borrowed(source));
    };
    let adds = markup_adds(&tree);
    if adds.is_empty() {
        return Ok(Cow::Borrowed(source));
    }
    let unplaceable = |line: u16| Error::TemplateUnsupported {
        line: usize::from(line),
        construct: "a `+` beside a Markup string (`| safe`) that could not be rewritten".to_owned(),
    };
    let mut edits = Vec::with_capacity(adds.len() * 3);
    for add in &adds {
        let span = add.span();
        let (start, end) = (span.start_offset as usize, span.end_offset as usize);
        // Between the left operand and the operator there can only be
        // white space and the left operand's closing parentheses.
        let left_end = add.left.span().end_offset as usize;
        let plus = source
            .get(left_end..end)
            .and_then(|between| {
                between
                    .find(|c: char| !(c.is_whitespace() || c == ')'))
                    .filter(|&at| between[at..].starts_with('+'))
            })
            .map(|at| left_end + at)
            .ok_or_else(|| unplaceable(span.start_line))?;
        if start >= plus || end <= plus || end > source.len() {
            return Err(unplaceable(span.start_line));
        }
        edits.push(Edit {
            at: start,
            len: 0,
            insert: "(",
        });
        edits.push(Edit {
            at: plus,
            len: 1,
            insert: ") | __markup_add(",
        });
        edits.push(Edit {
            at: end,
            len: 0,
            insert: ")",
        });
    }
    // Stable: an opening and a closing never share an offset (a `+`
    // operand is never empty), so only equal texts keep their order.
    edits.sort_by_key(|edit| edit.at);
    let mut out = String::with_capacity(source.len() + edits.len() * 8);
    let mut from = 0;
    for edit in &edits {
        out.push_str(&source[from..edit.at]);
        out.push_str(edit.insert);
        from = edit.at + edit.len;
    }
    out.push_str(&source[from..]);
    // The result must parse, hold one filter per rewritten `+`, and leave
    // no `+` with a Markup operand behind.
    let first_line = adds[0].span().start_line;
    let rewritten = crate::support::parse_template(&out).map_err(|_| unplaceable(first_line))?;
    if !markup_adds(&rewritten).is_empty() || count_markup_add_filters(&rewritten) != adds.len() {
        return Err(unplaceable(first_line));
    }
    Ok(Cow::Owned(out))
}

/// How many [`MARKUP_ADD`] filters `tree` applies.
fn count_markup_add_filters(tree: &ast::Stmt<'_>) -> usize {
    fn expr(e: &ast::Expr<'_>, n: &mut usize) {
        if let ast::Expr::Filter(f) = e
            && f.name == MARKUP_ADD
        {
            *n += 1;
        }
        for_each_subexpr(e, &mut |sub| expr(sub, n));
    }
    fn stmt(s: &ast::Stmt<'_>, n: &mut usize) {
        for_each_child(s, &mut |child| match child {
            Child::Stmt(s) => stmt(s, n),
            Child::Expr(e) => expr(e, n),
        });
    }
    let mut n = 0;
    stmt(tree, &mut n);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewritten(source: &str) -> String {
        rewrite_adds(source).expect("rewrites").into_owned()
    }

    #[test]
    fn each_add_beside_markup_becomes_the_filter_and_nothing_else_changes() {
        let cases = [
            (
                "{{ 'a' | safe + b }}",
                "{{ ('a' | safe ) | __markup_add( b) }}",
            ),
            // Offsets are bytes: text before the `+` may be any UTF-8.
            (
                "héllo ✓ {{ 'é✓'|safe + b }}",
                "héllo ✓ {{ ('é✓'|safe ) | __markup_add( b) }}",
            ),
            (
                "{{- b + 'a'|safe -}}",
                "{{- (b ) | __markup_add( 'a'|safe) -}}",
            ),
            // A chain: the outer `+` has the inner one as its left operand.
            (
                "{{ x|safe + y + z }}",
                "{{ ((x|safe ) | __markup_add( y) ) | __markup_add( z) }}",
            ),
            // Parentheses on either side stay where they were.
            (
                "{{ (x|safe) + (y) }}",
                "{{ ((x|safe) ) | __markup_add( (y)) }}",
            ),
            (
                "{{ y + (x|safe + z) }}",
                "{{ (y ) | __markup_add( ((x|safe ) | __markup_add( z))) }}",
            ),
            // A variable and a namespace attribute set from Markup, and a
            // variable set from one of those (the fixed point).
            (
                "{% set a = '<'|safe %}{% set b = a %}{{ b + c }}",
                "{% set a = '<'|safe %}{% set b = a %}{{ (b ) | __markup_add( c) }}",
            ),
            (
                "{% set ns.p = x|e %}{{ ns.p + c }}",
                "{% set ns.p = x|e %}{{ (ns.p ) | __markup_add( c) }}",
            ),
            (
                "{% set b | safe %}<{% endset %}{{ c + b }}",
                "{% set b | safe %}<{% endset %}{{ (c ) | __markup_add( b) }}",
            ),
            // A conditional either of whose branches is Markup; an `+`
            // inside a `for` and a `set`; a line break inside the `+`.
            (
                "{{ (x|safe if c else '') + d }}",
                "{{ ((x|safe if c else '') ) | __markup_add( d) }}",
            ),
            (
                "{% for i in [x|safe + y] %}{% set z = i\n+ x|safe %}{% endfor %}",
                "{% for i in [(x|safe ) | __markup_add( y)] %}{% set z = (i\n) | __markup_add( x|safe) %}{% endfor %}",
            ),
        ];
        for (source, want) in cases {
            assert_eq!(rewritten(source), want, "{source}");
        }
    }

    #[test]
    fn templates_without_markup_beside_a_plus_are_compiled_as_written() {
        for source in [
            "{{ a + b }}{% set n = 1 + 2 %}{{ n + [1] }}",
            "{{ x|safe ~ y }}{{ (x|safe ~ y) + z }}",
            "{{ x|tojson + y }}{{ x|safe }}{{ a + b|trim }}",
            "{% set s = x|safe %}{% set s = 1 %}{{ t + 1 }}",
            "{{ 'unparsable' + }}",
        ] {
            assert!(
                matches!(rewrite_adds(source), Ok(Cow::Borrowed(same)) if same == source),
                "{source}"
            );
        }
    }

    #[test]
    fn markupsafe_escapes_five_characters() {
        assert_eq!(
            escape_html(r#"a&b<c>d'e"f/g"#),
            "a&amp;b&lt;c&gt;d&#39;e&#34;f/g"
        );
        assert!(matches!(escape_html("plain text"), Cow::Borrowed(_)));
    }

    fn safe(text: &str) -> Value {
        Value::from_safe_string(text.to_owned())
    }

    #[test]
    fn markup_plus_a_string_escapes_the_string_either_side() {
        let joined = markup_add(safe("<b>"), Value::from("'x' & y")).unwrap();
        assert_eq!(joined.as_str(), Some("<b>&#39;x&#39; &amp; y"));
        assert!(joined.is_safe());
        let joined = markup_add(Value::from("\"q\""), safe("<i>")).unwrap();
        assert_eq!(joined.as_str(), Some("&#34;q&#34;<i>"));
        assert!(joined.is_safe());
        // Markup + Markup: neither is escaped again.
        let joined = markup_add(safe("<a>"), safe("&amp;")).unwrap();
        assert_eq!(joined.as_str(), Some("<a>&amp;"));
        assert!(joined.is_safe());
    }

    #[test]
    fn markup_plus_anything_else_is_refused_as_python_refuses_it() {
        let cases = [
            (safe("a"), Value::from(1), "'Markup' and 'int'"),
            (Value::from(1.5), safe("a"), "'float' and 'Markup'"),
            (safe("a"), Value::from(()), "'Markup' and 'NoneType'"),
            (Value::from(()), safe("a"), "'NoneType' and 'Markup'"),
            (safe("a"), Value::from(true), "'Markup' and 'bool'"),
            (safe("a"), Value::from(vec![1]), "'Markup' and 'list'"),
            (Value::from(vec![1]), safe("a"), "(not \"Markup\") to list"),
        ];
        for (lhs, rhs, message) in cases {
            let err = markup_add(lhs.clone(), rhs.clone()).unwrap_err();
            assert!(
                err.to_string().contains(message),
                "{lhs:?} + {rhs:?}: {err}"
            );
        }
        let err = markup_add(safe("a"), Value::UNDEFINED).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UndefinedError);
    }

    /// Without a safe operand the filter is minijinja's own `+` in the
    /// environment chat templates render in: the same value (and kind),
    /// or an error of the same kind where `+` errs.
    #[test]
    fn without_markup_it_is_minijinjas_plus() {
        let template = crate::ChatTemplate::new(
            "{{ messages }}",
            crate::SpecialTokens::default(),
            crate::RenderLimits::default(),
            std::sync::Arc::new(crate::FixedClock(0)),
        )
        .unwrap();
        let env = template.environment();
        let operands = [
            Value::from(1),
            Value::from(i64::MAX),
            Value::from(u64::MAX),
            Value::from(i128::MAX),
            Value::from(2.5),
            Value::from(true),
            Value::from("ab"),
            Value::from(vec![1, 2]),
            Value::from(()),
            Value::UNDEFINED,
            Value::from_serialize(serde_json::json!({"k": 1})),
        ];
        let add = env.compile_expression("a + b").unwrap();
        for lhs in &operands {
            for rhs in &operands {
                let want = add.eval(minijinja::context! { a => lhs, b => rhs });
                let got = markup_add(lhs.clone(), rhs.clone());
                match (&want, &got) {
                    (Ok(want), Ok(got)) => {
                        assert_eq!(want.kind(), got.kind(), "{lhs:?} + {rhs:?}");
                        assert_eq!(want.to_string(), got.to_string(), "{lhs:?} + {rhs:?}");
                        assert!(!got.is_safe());
                    }
                    (Err(want), Err(got)) => {
                        assert_eq!(want.kind(), got.kind(), "{lhs:?} + {rhs:?}");
                    }
                    _ => panic!("{lhs:?} + {rhs:?}: minijinja {want:?}, filter {got:?}"),
                }
            }
        }
    }

    #[test]
    fn escape_filters_write_markupsafes_entities() {
        let escaped = escape(Value::from("<'\">&"));
        assert_eq!(escaped.as_str(), Some("&lt;&#39;&#34;&gt;&amp;"));
        assert!(escaped.is_safe());
        assert_eq!(escape(safe("<b>")).as_str(), Some("<b>"));
        assert_eq!(forceescape(safe("<b>")).as_str(), Some("&lt;b&gt;"));
        // Python's str() of other values.
        assert_eq!(escape(Value::from(())).as_str(), Some("None"));
        assert_eq!(
            escape(Value::from(vec!["a'"])).as_str(),
            Some("[&#34;a&#39;&#34;]")
        );
        assert_eq!(escape(Value::UNDEFINED).as_str(), Some(""));
    }
}
