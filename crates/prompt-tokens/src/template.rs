//! Chat-template rendering: Hugging Face `chat_template` Jinja on minijinja.
//!
//! The environment mirrors what `transformers` gives a chat template:
//! `trim_blocks` and `lstrip_blocks` on, loop controls, Python string and
//! dict methods (minijinja-contrib's `pycompat`), a `tojson` filter that
//! writes what Python's `json.dumps(..., ensure_ascii=False)` writes (`", "`
//! and `": "` separators, `indent`, `sort_keys`), `raise_exception(msg)`
//! (becomes [`Error::TemplateRaised`]), `strftime_now(fmt)` (the date
//! from an injectable [`Clock`]), and jinja2's generator filters (`map`,
//! `select`, ...) returning one-shot generators (module `generators`).
//!
//! Hostile templates and inputs are bounded three ways ([`RenderLimits`]):
//! the template's size, minijinja's fuel (every instruction costs one unit,
//! so loops end), and the rendered output's size (a writer that refuses
//! to grow past the cap).

use std::fmt;
use std::sync::Arc;

use minijinja::value::{Value, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind};

use crate::direct::DirectTemplate;
use crate::error::{Error, Result};
use crate::interrupt::Interrupt;
use crate::messages::{self, ContentFormat};
use crate::request::{ChatRequest, object_from_pairs};

/// Bounds on a chat template and on one rendering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderLimits {
    /// Largest template source accepted, in bytes. Default 256 KiB (real
    /// templates are under 30 KiB).
    pub max_template_bytes: usize,
    /// minijinja fuel per rendering (roughly one unit per instruction).
    /// Default 20 million: a 1,000-message conversation with tools uses a
    /// small fraction of it.
    pub fuel: u64,
    /// Largest rendered prompt, in bytes. Default 16 MiB.
    pub max_output_bytes: usize,
}

impl Default for RenderLimits {
    fn default() -> Self {
        Self {
            max_template_bytes: 256 * 1024,
            fuel: 20_000_000,
            max_output_bytes: 16 * 1024 * 1024,
        }
    }
}

/// Where `strftime_now` gets the time. Inject a [`FixedClock`] for
/// deterministic tests; [`SystemClock`] is the default.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Seconds since the Unix epoch, UTC.
    fn now_unix_seconds(&self) -> i64;
}

/// The machine's clock (UTC).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_unix_seconds(&self) -> i64 {
        match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
        }
    }
}

/// A clock that always says the same instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedClock(pub i64);

impl Clock for FixedClock {
    fn now_unix_seconds(&self) -> i64 {
        self.0
    }
}

/// Special-token strings a template may print (`bos_token`, `eos_token`, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token`, when the model has one.
    pub bos: Option<String>,
    /// `eos_token`, when the model has one.
    pub eos: Option<String>,
    /// `unk_token`, when the model has one.
    pub unk: Option<String>,
    /// `pad_token`, when the model has one.
    pub pad: Option<String>,
}

/// Marker carried as the source of the error `raise_exception` returns.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

const NAME: &str = "chat";

/// The message of the [`Error::Render`] a rendering ends with when
/// minijinja panics (see [`ChatTemplate::render`]).
pub(crate) const ENGINE_PANICKED: &str =
    "internal error of the template engine (minijinja panicked)";

/// A compiled chat template with its limits, clock and special tokens.
/// `Send + Sync`; rendering takes `&self`.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template compiled for direct rendering, or why it is not.
    direct: std::result::Result<DirectTemplate, String>,
    direct_enabled: bool,
    clock: Arc<dyn Clock>,
    source_len: usize,
    limits: RenderLimits,
    special: SpecialTokens,
    content_format: ContentFormat,
    /// Messages prepared for this template's format, by the identity of
    /// messages read through a message memo (see [`messages::PreparedMemo`]).
    prepared: messages::PreparedMemo,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source_len)
            .field("direct", &self.direct_rendering())
            .field("limits", &self.limits)
            .field("special", &self.special)
            .field("content_format", &self.content_format)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`. Fails with [`Error::TemplateTooLarge`],
    /// [`Error::TemplateSyntax`] or, for a filter, test, method or function
    /// this renderer does not have, [`Error::TemplateUnsupported`] (also
    /// for a `+` beside a `| safe` string that the load-time rewrite could
    /// not place, which no known template has).
    pub fn new(
        source: &str,
        special: SpecialTokens,
        limits: RenderLimits,
        clock: Arc<dyn Clock>,
    ) -> Result<Self> {
        if source.len() > limits.max_template_bytes {
            return Err(Error::TemplateTooLarge {
                len: source.len(),
                max: limits.max_template_bytes,
            });
        }
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(limits.fuel));
        // The default (500) lets a recursive macro grow the native stack
        // deep enough to matter on small thread stacks.
        env.set_recursion_limit(100);
        // jinja2's and Python's filters, tests and string methods where
        // minijinja has none or another meaning (module `pyfilters`).
        crate::pyfilters::register(&mut env);
        // jinja2's `map`, `select` and the other filters that return
        // generators, read once and refused by `tojson` (module
        // `generators`).
        crate::generators::register(&mut env);
        // Strings (nearly everything a chat template prints) go straight to
        // the output; the default formatter sends them through `fmt`.
        // None, booleans, numbers, lists and dicts print as Python's
        // `str()` prints them (module `pyrepr`), as jinja2 does for the
        // engine. Anything else, or any auto-escaping, takes the default
        // path.
        env.set_formatter(|out, state, value| {
            if state.auto_escape() == AutoEscape::None {
                if let Some(text) = value.as_str() {
                    return out.write_str(text).map_err(minijinja::Error::from);
                }
                if let Some(text) = crate::pyrepr::python_str(value) {
                    return out.write_str(&text).map_err(minijinja::Error::from);
                }
            }
            minijinja::escape_formatter(out, state, value)
        });
        env.add_filter("tojson", crate::tojson::tojson);
        env.add_function("raise_exception", raise_exception);
        let env_clock = clock.clone();
        env.add_function("strftime_now", move |format: &str| -> Value {
            crate::clock_text::strftime_cached(format, env_clock.now_unix_seconds())
        });
        // transformers' `{% generation %}` extension (it marks assistant
        // text for training masks) renders its body unchanged.
        let source = crate::rewrite::generation_tags(source);
        // minijinja iterates None as nothing where Python raises; the loops
        // are guarded for minijinja only (the direct renderer declines on
        // None and leaves such a render to minijinja).
        env.add_filter(
            crate::rewrite::ITERABLE_GUARD,
            crate::rewrite::iterable_guard,
        );
        // jinja2's `Markup + str` escapes the plain operand; minijinja's
        // `+` does not, so each `+` that can meet a `| safe` string is
        // rewritten into a filter that does (module `markup`).
        env.add_filter(crate::markup::MARKUP_ADD, crate::markup::markup_add);
        // jinja2's escaping filters, with markupsafe's entities.
        env.add_filter("escape", crate::markup::escape);
        env.add_filter("e", crate::markup::escape);
        env.add_filter("forceescape", crate::markup::forceescape);
        let rendered_source = crate::markup::rewrite_adds(&source)?;
        env.add_template_owned(
            NAME,
            crate::rewrite::guard_for_loops(&rendered_source).into_owned(),
        )
        .map_err(|e| Error::TemplateSyntax(describe(&e)))?;
        // What this environment cannot render is refused now, with its
        // line, rather than on every request that reaches it.
        crate::support::check(&env, &source)?;
        Ok(Self {
            env,
            // The same source as minijinja's: the direct renderer declines
            // the rewritten `+` (an unknown filter to it), as it declines
            // every `+`.
            direct: DirectTemplate::compile(&rendered_source),
            direct_enabled: true,
            clock,
            source_len: source.len(),
            limits,
            special,
            content_format: ContentFormat::detect(&source),
            prepared: messages::PreparedMemo::default(),
        })
    }

    /// The minijinja environment the template renders in (for the load
    /// check's unit tests).
    #[cfg(test)]
    pub(crate) fn environment(&self) -> &Environment<'static> {
        &self.env
    }

    /// How this template expects message content: detected from the
    /// source as vLLM does (see [`ContentFormat::detect`]) unless set with
    /// [`with_content_format`](Self::with_content_format).
    pub fn content_format(&self) -> ContentFormat {
        self.content_format
    }

    /// Overrides the detected content format (vLLM's
    /// `--chat-template-content-format string|openai`).
    pub fn with_content_format(mut self, format: ContentFormat) -> Self {
        self.content_format = format;
        // Its messages were prepared for the other format.
        self.prepared = messages::PreparedMemo::default();
        self
    }

    /// Whether renderings go through the direct renderer first (see
    /// [`DirectRendering`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use prompt_tokens::{
    ///     ChatRequest, ChatTemplate, DirectRendering, FixedClock, RenderLimits, SpecialTokens,
    ///     TemplateFamily,
    /// };
    ///
    /// let template = ChatTemplate::new(
    ///     TemplateFamily::ChatMl.template(),
    ///     SpecialTokens::default(),
    ///     RenderLimits::default(),
    ///     Arc::new(FixedClock(0)),
    /// )?;
    /// assert_eq!(template.direct_rendering(), DirectRendering::On);
    /// let request = ChatRequest::new(&serde_json::json!([{"role": "user", "content": "Hi"}]))?;
    /// // The direct renderer's text is minijinja's.
    /// let direct = template.render_direct(&request).expect("a plain chat renders directly");
    /// let minijinja = template.with_direct_rendering(false).render(&request)?;
    /// assert_eq!(direct, minijinja);
    /// # Ok::<(), prompt_tokens::Error>(())
    /// ```
    pub fn direct_rendering(&self) -> DirectRendering<'_> {
        match (&self.direct, self.direct_enabled) {
            (Err(reason), _) => DirectRendering::Unsupported(reason),
            (Ok(_), false) => DirectRendering::Disabled,
            (Ok(_), true) => DirectRendering::On,
        }
    }

    /// Turns the direct renderer off (`false`) or back on: off, every
    /// rendering is minijinja's. The output is the same either way; this
    /// is for comparisons and as a safety valve.
    pub fn with_direct_rendering(mut self, on: bool) -> Self {
        self.direct_enabled = on;
        self
    }

    /// Bounds the render memo to `bytes` (0 turns it off; the default is
    /// [`DEFAULT_RENDER_MEMO_BYTES`](crate::DEFAULT_RENDER_MEMO_BYTES)).
    ///
    /// A conversation's next request repeats every earlier message, and
    /// the template's loop over the messages would print each again. The
    /// direct renderer keeps, per template, the state its top-level loop
    /// over the messages reached after all but the last one or two
    /// messages (the text printed, the namespace attributes set), keyed by
    /// those messages and by every value the loop's iterations read from
    /// outside themselves; a rendering whose loop starts in a state it
    /// finds resumes there and renders only what follows. The text is the
    /// full rendering's, byte for byte: the key is compared exactly, not
    /// by hash, and an iteration that reads what cannot be keyed
    /// (`loop.length`, `loop.revindex`, the whole messages list, the
    /// clock) makes the rendering store nothing. The bound counts the
    /// stored text and keys, over 16 shards, each evicting its oldest
    /// entries first unless used since they were last passed over (a
    /// second-chance FIFO, close to least-recently-used).
    pub fn with_render_memo(mut self, bytes: usize) -> Self {
        if let Ok(direct) = &mut self.direct {
            direct.set_memo_bytes(bytes);
        }
        self
    }

    /// How the render memo has served; `None` when the template has none
    /// (turned off, or the template does not render directly).
    pub fn render_memo_stats(&self) -> Option<crate::RenderMemoStats> {
        self.direct.as_ref().ok()?.memo_stats()
    }

    /// The direct renderer alone: `Some` with its text when it renders
    /// `request` itself, `None` when the template or this request is
    /// outside what it handles (then [`render`](Self::render) asks
    /// minijinja). For differential tests and diagnostics; `render` is
    /// the API. Prepares the request as `render` does, so with
    /// `continue_final_message` the text is cut at the final message.
    pub fn render_direct(&self, request: &ChatRequest) -> Option<String> {
        let direct = self.direct.as_ref().ok()?;
        let (ctx, final_text) = self.prepare(request).ok()?;
        let mut text = self.run_direct(direct, &ctx, request)?;
        if let Some(final_text) = &final_text {
            cut_at_continue_tag(&mut text, final_text).ok()?;
        }
        Some(text)
    }

    /// Why the direct renderer declines `request`: `None` when it renders
    /// it, else the construct (or the kind of value) it left to minijinja.
    /// A diagnostic for choosing what to teach the direct renderer next;
    /// the wording is not stable.
    #[doc(hidden)]
    pub fn direct_decline_reason(&self, request: &ChatRequest) -> Option<String> {
        let direct = match &self.direct {
            Ok(direct) => direct,
            Err(reason) => return Some(format!("template: {reason}")),
        };
        let ctx = match self.prepare(request) {
            Ok((ctx, _)) => ctx,
            Err(e) => return Some(format!("request: {e}")),
        };
        direct
            .render(
                &ctx,
                &|| self.clock.now_unix_seconds(),
                self.limits.max_output_bytes,
                self.limits.fuel,
                self.output_hint(request),
            )
            .err()
            .map(str::to_owned)
    }

    /// `direct`'s rendering of the context `ctx` under this template's
    /// clock and limits; `None` when it declines.
    fn run_direct(
        &self,
        direct: &DirectTemplate,
        ctx: &[(Value, Value)],
        request: &ChatRequest,
    ) -> Option<String> {
        direct
            .render(
                ctx,
                &|| self.clock.now_unix_seconds(),
                self.limits.max_output_bytes,
                self.limits.fuel,
                self.output_hint(request),
            )
            .ok()
    }

    /// The limits this template renders under.
    pub fn limits(&self) -> RenderLimits {
        self.limits
    }

    /// Renders `request` to the prompt text.
    pub fn render(&self, request: &ChatRequest) -> Result<String> {
        self.render_until(request, None)
    }

    /// [`render`](Self::render) with `interrupt`'s checkpoints: after the
    /// messages are prepared, and before minijinja renders what the direct
    /// renderer declined.
    pub(crate) fn render_until(
        &self,
        request: &ChatRequest,
        interrupt: Option<&Interrupt>,
    ) -> Result<String> {
        let (ctx, final_text) = self.prepare_until(request, interrupt)?;
        if self.direct_enabled
            && let Ok(direct) = &self.direct
            && let Some(mut text) = self.run_direct(direct, &ctx, request)
        {
            if let Some(final_text) = &final_text {
                cut_at_continue_tag(&mut text, final_text)?;
            }
            return Ok(text);
        }
        crate::interrupt::check(interrupt)?;
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| Error::Render(describe(&e)))?;
        let ctx = object_from_pairs(ctx);
        let mut out = CappedWriter {
            buf: Vec::with_capacity(self.output_hint(request).min(self.limits.max_output_bytes)),
            max: self.limits.max_output_bytes,
            overflow: false,
        };
        // minijinja has panicked on input (2.24 reverses an empty sequence
        // or string, `[][::-1]`, by indexing into it); a request must get
        // an error, so its panics end this rendering only. Nothing it
        // touched outlives the call but `out`, which is discarded then.
        let rendered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            template.render_captured_to(ctx, &mut out)
        }));
        let Ok(rendered) = rendered else {
            return Err(Error::Render(ENGINE_PANICKED.into()));
        };
        if let Err(e) = rendered {
            return Err(if out.overflow {
                Error::OutputTooLarge {
                    max: self.limits.max_output_bytes,
                }
            } else {
                classify(&e)
            });
        }
        let mut text = String::from_utf8(out.buf)
            .map_err(|_| Error::Render("rendered output is not UTF-8".into()))?;
        if let Some(final_text) = &final_text {
            cut_at_continue_tag(&mut text, final_text)?;
        }
        Ok(text)
    }

    /// The rendering's context, and the final message's text when the
    /// request continues it (its message then carries the cut tag).
    fn prepare(&self, request: &ChatRequest) -> Result<Prepared> {
        self.prepare_until(request, None)
    }

    /// [`prepare`](Self::prepare) with `interrupt`'s checkpoint after the
    /// messages are prepared.
    fn prepare_until(
        &self,
        request: &ChatRequest,
        interrupt: Option<&Interrupt>,
    ) -> Result<Prepared> {
        if request.add_generation_prompt && request.continue_final_message {
            return Err(Error::InvalidRequest(
                "add_generation_prompt and continue_final_message cannot both be true".into(),
            ));
        }
        let mut messages = messages::prepare_with(
            &request.messages.0,
            self.content_format,
            request.messages_shared.then_some(&self.prepared),
        )?;
        let final_text = if request.continue_final_message {
            let (tagged, final_text) = tag_final_message(&messages)?;
            messages = tagged;
            Some(final_text)
        } else {
            None
        };
        crate::interrupt::check(interrupt)?;
        let ctx = self.context(request, messages)?;
        Ok((ctx, final_text))
    }

    /// The rendering's context as (name, value) pairs, each name once:
    /// what `transformers` passes a chat template. Fails on `tools` vLLM's
    /// request model refuses (see [`vllm_tools`]).
    fn context(&self, request: &ChatRequest, messages: Value) -> Result<Vec<(Value, Value)>> {
        let mut ctx: Vec<(Value, Value)> = Vec::with_capacity(8);
        ctx.push((Value::from("messages"), messages));
        ctx.push((
            Value::from("add_generation_prompt"),
            Value::from(request.add_generation_prompt),
        ));
        // Absent, they are None, as vLLM passes them to transformers:
        // `tools is not none` is false and `tools | length` an error.
        let tools = match &request.tools {
            Some(tools) => vllm_tools(&tools.0)?,
            None => Value::from(()),
        };
        ctx.push((Value::from("tools"), tools));
        let documents = request
            .documents
            .as_ref()
            .map_or_else(|| Value::from(()), |v| v.0.clone());
        ctx.push((Value::from("documents"), documents));
        for (name, value) in [
            ("bos_token", &self.special.bos),
            ("eos_token", &self.special.eos),
            ("unk_token", &self.special.unk),
            ("pad_token", &self.special.pad),
        ] {
            if let Some(value) = value {
                ctx.push((Value::from(name), Value::from(value.as_str())));
            }
        }
        // chat_template_kwargs come last and win, as in vLLM's renderer
        // (a repeated name keeps its first position and its last value).
        if let Some(kwargs) = &request.chat_template_kwargs
            && kwargs.0.kind() == ValueKind::Map
            && let Ok(keys) = kwargs.0.try_iter()
        {
            for key in keys {
                if key.as_str().is_none() {
                    continue;
                }
                if let Ok(value) = kwargs.0.get_item(&key) {
                    match ctx.iter_mut().find(|(k, _)| *k == key) {
                        Some(slot) => slot.1 = value,
                        None => ctx.push((key, value)),
                    }
                }
            }
        }
        Ok(ctx)
    }

    /// The rendering is mostly the messages' text: start with room for
    /// the body, so the buffer does not grow by doubling and copying.
    fn output_hint(&self, request: &ChatRequest) -> usize {
        request.body_len.saturating_add(request.body_len / 4) + 256
    }
}

/// Whether a [`ChatTemplate`] renders through the direct renderer: the
/// template's syntax tree walked over the request's values without
/// minijinja's virtual machine, for the constructs chat templates use.
/// A rendering the direct renderer does not handle (a construct it
/// declines, an error, a limit) is redone by minijinja, so the text and
/// the errors are minijinja's either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectRendering<'a> {
    /// Renderings try the direct renderer first.
    On,
    /// Turned off with [`ChatTemplate::with_direct_rendering`].
    Disabled,
    /// The template uses a construct the direct renderer never handles
    /// (inheritance, includes, imports, autoescape, a macro defined in a
    /// block or twice); named here.
    Unsupported(&'a str),
}

/// `tools` as vLLM hands them to the template: each validated into its
/// request model (`ChatCompletionToolsParam` holding a
/// `FunctionDefinition`, pydantic with extra fields allowed) and dumped
/// back, so the template sees `{"type": "function", "function": {"name",
/// "description", "parameters", ...}, ...}` in that key order, with
/// `description` and `parameters` `None` when the client left them out and
/// any other keys after the declared ones, in the client's order. A tool
/// the model refuses (not an object, a `type` other than `"function"`, no
/// string `name`, a `description` that is not a string, `parameters` that
/// are not an object) is [`Error::InvalidRequest`], where vLLM answers 400.
/// `null` is `None`.
fn vllm_tools(tools: &Value) -> Result<Value> {
    if tools.is_none() || tools.is_undefined() {
        return Ok(Value::from(()));
    }
    let invalid = |why: &str| Error::InvalidRequest(format!("tools: {why}"));
    if tools.kind() != ValueKind::Seq {
        return Err(invalid("must be a list"));
    }
    let field = |map: &Value, key: &str| map.get_attr(key).unwrap_or(Value::UNDEFINED);
    let absent = |v: &Value| v.is_undefined() || v.is_none();
    let mut out = Vec::new();
    for tool in tools.try_iter().map_err(|_| invalid("must be a list"))? {
        if tool.kind() != ValueKind::Map {
            return Err(invalid("each tool must be an object"));
        }
        let kind = field(&tool, "type");
        if !kind.is_undefined() && kind.as_str() != Some("function") {
            return Err(invalid("a tool's type must be \"function\""));
        }
        let function = field(&tool, "function");
        if function.kind() != ValueKind::Map {
            return Err(invalid("each tool needs a 'function' object"));
        }
        let name = field(&function, "name");
        if name.kind() != ValueKind::String {
            return Err(invalid("a function needs a string 'name'"));
        }
        let description = field(&function, "description");
        let description = if absent(&description) {
            Value::from(())
        } else if description.kind() == ValueKind::String {
            description
        } else {
            return Err(invalid("a function's 'description' must be a string"));
        };
        let parameters = field(&function, "parameters");
        let parameters = if absent(&parameters) {
            Value::from(())
        } else if parameters.kind() == ValueKind::Map {
            parameters
        } else {
            return Err(invalid("a function's 'parameters' must be an object"));
        };
        let mut function_pairs = vec![
            (Value::from("name"), name),
            (Value::from("description"), description),
            (Value::from("parameters"), parameters),
        ];
        extra_pairs(
            &function,
            &["name", "description", "parameters"],
            &mut function_pairs,
        );
        let mut tool_pairs = vec![
            (Value::from("type"), Value::from("function")),
            (Value::from("function"), object_from_pairs(function_pairs)),
        ];
        extra_pairs(&tool, &["type", "function"], &mut tool_pairs);
        out.push(object_from_pairs(tool_pairs));
    }
    Ok(Value::from(out))
}

/// The pairs of `map` whose keys are not `declared`, in `map`'s order,
/// appended to `into` (pydantic's extra fields, dumped after the declared
/// ones).
fn extra_pairs(map: &Value, declared: &[&str], into: &mut Vec<(Value, Value)>) {
    let Ok(keys) = map.try_iter() else { return };
    for key in keys {
        if key.as_str().is_some_and(|k| declared.contains(&k)) {
            continue;
        }
        if let Ok(value) = map.get_item(&key) {
            into.push((key, value));
        }
    }
}

/// What transformers appends to the final message's text (its last text
/// part) for `continue_final_message`, to find where that text ends in the
/// rendering, whatever the template did around it.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// `continue_final_message`, before rendering: the messages with
/// [`CONTINUE_TAG`] appended to the final message's text, as transformers
/// prepares them, and that text as it was.
fn tag_final_message(messages: &Value) -> Result<(Value, String)> {
    let no_text = || {
        Error::InvalidRequest(
            "continue_final_message is set but the final message has no text to continue".into(),
        )
    };
    let count = messages.len().unwrap_or(0);
    let last = messages
        .get_item(&Value::from(count.checked_sub(1).ok_or_else(no_text)?))
        .map_err(|_| no_text())?;
    let content = last.get_attr("content").map_err(|_| no_text())?;
    let (tagged, final_text) = if let Some(text) = content.as_str() {
        (
            Value::from(format!("{text}{CONTINUE_TAG}")),
            text.to_owned(),
        )
    } else if content.kind() == ValueKind::Seq {
        // The last part that has a text.
        let parts: Vec<Value> = content.try_iter().map_err(|_| no_text())?.collect();
        let at = parts
            .iter()
            .rposition(|p| p.get_attr("text").is_ok_and(|t| !t.is_undefined()))
            .ok_or_else(no_text)?;
        let text = parts[at]
            .get_attr("text")
            .ok()
            .and_then(|t| t.as_str().map(str::to_owned))
            .ok_or_else(no_text)?;
        let mut parts = parts;
        parts[at] = with_attr(
            &parts[at],
            "text",
            Value::from(format!("{text}{CONTINUE_TAG}")),
        );
        (Value::from(parts), text)
    } else {
        return Err(no_text());
    };
    let mut list: Vec<Value> = messages.try_iter().map_err(|_| no_text())?.collect();
    if let Some(slot) = list.last_mut() {
        *slot = with_attr(&last, "content", tagged);
    }
    Ok((Value::from(list), final_text))
}

/// `map` with `key` set to `value` (in its place when present, else
/// last), keys in their order.
fn with_attr(map: &Value, key: &str, value: Value) -> Value {
    let mut pairs: Vec<(Value, Value)> = Vec::new();
    let mut set = false;
    if let Ok(keys) = map.try_iter() {
        for k in keys {
            if k.as_str() == Some(key) {
                pairs.push((k, value.clone()));
                set = true;
            } else if let Ok(v) = map.get_item(&k) {
                pairs.push((k, v));
            }
        }
    }
    if !set {
        pairs.push((Value::from(key), value));
    }
    object_from_pairs(pairs)
}

/// `continue_final_message`, after rendering: as transformers does, the
/// rendering ends where [`CONTINUE_TAG`] begins, with the final message's
/// trailing whitespace when the template kept the tag's own trailing
/// space, stripped of trailing whitespace otherwise. A rendering that lost
/// the final text or the tag is refused, as transformers refuses it.
fn cut_at_continue_tag(text: &mut String, final_text: &str) -> Result<()> {
    let tag = CONTINUE_TAG.trim_end();
    if !text.contains(python_strip(final_text)) || !text.contains(tag) {
        return Err(Error::InvalidRequest(
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template".into(),
        ));
    }
    let Some(at) = text.rfind(tag) else {
        return Ok(());
    };
    let kept_space = text[at..].starts_with(CONTINUE_TAG);
    text.truncate(at);
    if !kept_space {
        let end = text.trim_end_matches(python_space).len();
        text.truncate(end);
    }
    Ok(())
}

/// Python's `str.isspace` for one character: Unicode whitespace and the
/// four ASCII separators (0x1C-0x1F) Python counts as spaces.
fn python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip()`.
pub(crate) fn python_strip(text: &str) -> &str {
    text.trim_matches(python_space)
}

/// A rendering's context (name, value pairs) and, with
/// `continue_final_message`, the final message's text to cut at.
type Prepared = (Vec<(Value, Value)>, Option<String>);

struct CappedWriter {
    buf: Vec<u8>,
    max: usize,
    overflow: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.max {
            self.overflow = true;
            return Err(std::io::Error::other("rendered output too large"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    // minijinja writes every printed piece with `write_all`; the default
    // loops over `write`, and a piece is always taken whole here.
    fn write_all(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.write(data).map(drop)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    // The "referenced from" detail (template source around the error)
    // can be long; the first line is the message.
    if let Some(line) = s.lines().next() {
        s = line.to_owned();
    }
    s
}

fn classify(e: &minijinja::Error) -> Error {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(raised) = err.downcast_ref::<Raised>() {
            return Error::TemplateRaised(raised.0.clone());
        }
        source = err.source();
    }
    if e.kind() == ErrorKind::OutOfFuel {
        return Error::FuelExhausted;
    }
    Error::Render(describe(e))
}

fn raise_exception(message: Value) -> Result<Value, minijinja::Error> {
    let message = message
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| message.to_string());
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, "raise_exception called")
            .with_source(Raised(message)),
    )
}
