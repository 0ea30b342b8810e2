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
//! The subset is what real chat templates use on ordinary requests:
//! `+` of two strings, two integers or two sequences (minijinja's lazy
//! concatenation, module `value`, `Chain`), integer `-` and `%`, slices
//! and `seq[::-1]` as a loop's sequence, integer indexes into slices and
//! concatenations, dict literals, `namespace` attributes, `loop.*`,
//! `for k, v in map.items()` and `map | dictsort` (any mapping, through
//! minijinja's own `dictsort`), `in` a list, a string or a mapping,
//! macros (constant defaults, recursion, keyword arguments, calls of
//! macros defined later, names read from the top level as minijinja's
//! closures read them, a parameter named `namespace`), string methods
//! (`strip` and its kin with or without characters, `split`, `replace`,
//! `startswith`, `endswith`, `format` through minijinja's own
//! `format_filter`), a mapping's `get`, the filters `trim`, `length`,
//! `tojson`, `default`, `string`, `list`, `join`, `min` and `max` of
//! integers and `selectattr(name, "equalto", v) | list`, and the usual
//! tests. Each declining node names its construct, so
//! `ChatTemplate::direct_decline_reason` (and the corpus test with
//! `TEMPLATE_CORPUS_DIRECT=1`) says what keeps a template on minijinja.
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

mod compile;
mod memo;
mod run;
mod tree;
mod value;

use minijinja::machinery::ast;
use minijinja::value::Value;

use compile::{Compiler, Scope, collect_assigned};
use memo::Memo;
pub use memo::{DEFAULT_RENDER_MEMO_BYTES, RenderMemoStats};
use run::Run;
use tree::{MacroDef, Stmt};

/// Why a rendering was not done directly; minijinja redoes it. Carries
/// the place in this module that declined (for diagnostics).
#[derive(Debug)]
pub(crate) struct Declined(&'static str);

/// A [`Declined`] naming the line it is made on.
macro_rules! declined {
    () => {
        $crate::direct::Declined(concat!(file!(), ":", line!()))
    };
}
use declined;

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
    /// The namespace attributes the template names (module `memo`).
    ns_fields: Vec<Box<str>>,
    /// The states of earlier renderings' message loops (module `memo`);
    /// `None` when turned off.
    memo: Option<Memo>,
}

impl DirectTemplate {
    /// Compiles `source` as minijinja parses it with `trim_blocks` and
    /// `lstrip_blocks` on. `Err` names the construct that keeps the
    /// template on minijinja.
    pub(crate) fn compile(source: &str) -> Result<Self, String> {
        let tree =
            crate::support::parse_template(source).map_err(|e| format!("does not parse: {e}"))?;
        let ast::Stmt::Template(root) = &tree else {
            return Err("the parser did not return a template".into());
        };
        let mut assigned = Vec::new();
        collect_assigned(&root.children, &mut assigned);
        let top_macros = root
            .children
            .iter()
            .filter_map(|stmt| match stmt {
                ast::Stmt::Macro(m) => Some((
                    m.name,
                    m.args
                        .iter()
                        .map(|arg| match arg {
                            ast::Expr::Var(v) => v.id,
                            // Such a macro is refused when compiled.
                            _ => "",
                        })
                        .collect(),
                )),
                _ => None,
            })
            .collect();
        let mut compiler = Compiler {
            names: Vec::new(),
            macros: Vec::new(),
            macro_names: Vec::new(),
            top_macros,
            assigned_outside_macros: assigned,
            called_builtins: Vec::new(),
            ns_fields: Vec::new(),
            scope: Scope::default(),
        };
        let body = compiler.block(&root.children, true)?;
        let macros = compiler.macros;
        Ok(Self {
            body,
            macros,
            names: compiler.names,
            called_builtins: compiler.called_builtins,
            ns_fields: compiler.ns_fields,
            memo: Memo::new(DEFAULT_RENDER_MEMO_BYTES),
        })
    }

    /// Bounds the render memo to `bytes` (0: no memo); stored states are
    /// dropped.
    pub(crate) fn set_memo_bytes(&mut self, bytes: usize) {
        self.memo = Memo::new(bytes);
    }

    /// The render memo's counters; `None` without a memo.
    pub(crate) fn memo_stats(&self) -> Option<RenderMemoStats> {
        self.memo.as_ref().map(Memo::stats)
    }

    /// Renders with the context `globals` (name, value pairs, each name
    /// once), or declines with the construct that kept it from rendering.
    pub(crate) fn render<'t>(
        &'t self,
        globals: &'t [(Value, Value)],
        clock_seconds: &'t dyn Fn() -> i64,
        max_output: usize,
        fuel: u64,
        capacity: usize,
    ) -> Result<String, &'t str> {
        let mut by_name: Vec<Option<&Value>> = vec![None; self.names.len()];
        let mut messages = None;
        for (key, value) in globals {
            let Some(key) = key.as_str() else { continue };
            if key == "messages" {
                messages = value::vec_items(value);
            }
            if let Some(at) = self.names.iter().position(|n| **n == *key) {
                by_name[at] = Some(value);
            }
        }
        if self
            .called_builtins
            .iter()
            .any(|&n| by_name[usize::from(n)].is_some())
        {
            return Err("a context value shadows a function the template calls");
        }
        let mut run = Run {
            template: self,
            globals: by_name,
            vars: Vec::with_capacity(16),
            barrier: 0,
            macros_defined: 0,
            top_end: 0,
            loops: Vec::with_capacity(4),
            flow: run::Flow::Next,
            namespaces: Vec::new(),
            out: String::with_capacity(capacity.min(max_output)),
            max_output,
            steps_left: fuel / FUEL_PER_STEP,
            depth: 0,
            clock_seconds,
            declined_at: None,
            memo: self.memo.as_ref(),
            messages,
            rec: None,
            capturing: 0,
            encoded: None,
        };
        match run.exec(&self.body) {
            Ok(()) => Ok(run.out),
            // A `Decline` node names its construct; any other decline
            // is a value, limit or operation outside the plain cases,
            // named by the place that refused it.
            Err(Declined(at)) => Err(run.declined_at.unwrap_or(at)),
        }
    }
}
