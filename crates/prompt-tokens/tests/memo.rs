//! The render memo (`src/direct/memo.rs`): a conversation rendered turn by
//! turn, with the memo resuming each turn's message loop from the state an
//! earlier turn stored, renders every turn exactly as a cold rendering
//! (no memo) and as minijinja alone.
//!
//! Small templates probe what an iteration can read: a namespace it
//! updates, `loop.first` / `loop.last`, `previtem` / `nextitem`, a slice of
//! the messages, variables set before the loop, the context's flags and
//! tools. Those whose iterations read what the memo cannot key on
//! (`loop.length`, `loop.revindex`, the whole messages list, the clock)
//! must never resume. The real templates are tested the same way by
//! `tests/corpus.rs` (`the_render_memo_renders_every_turn_...`).

use std::sync::Arc;

use prompt_tokens::{
    ChatRequest, ChatTemplate, FixedClock, RenderLimits, SpecialTokens, TemplateFamily,
};
use serde_json::{Value, json};

/// `source` compiled three ways: with the memo, without it (direct, cold),
/// and minijinja alone.
struct Three {
    memo: ChatTemplate,
    cold: ChatTemplate,
    minijinja: ChatTemplate,
}

impl Three {
    fn new(source: &str, special: SpecialTokens) -> Self {
        let compile = || {
            ChatTemplate::new(
                source,
                special.clone(),
                RenderLimits::default(),
                Arc::new(FixedClock(1_700_000_000)),
            )
            .unwrap_or_else(|e| panic!("{e}: {source}"))
        };
        Self {
            memo: compile(),
            cold: compile().with_render_memo(0),
            minijinja: compile().with_direct_rendering(false),
        }
    }

    /// Renders `body` all three ways and checks they agree.
    fn check(&self, body: &Value) {
        let request = ChatRequest::from_json(body.to_string().as_bytes()).expect("a request");
        let memo = self.memo.render(&request).map_err(|e| e.to_string());
        let cold = self.cold.render(&request).map_err(|e| e.to_string());
        let minijinja = self.minijinja.render(&request).map_err(|e| e.to_string());
        assert_eq!(memo, cold, "memo against cold: {body}");
        assert_eq!(cold, minijinja, "cold against minijinja: {body}");
    }

    fn hits(&self) -> u64 {
        self.memo.render_memo_stats().expect("a memo").hits
    }
}

fn conversation(turns: usize) -> Vec<Value> {
    let mut messages = vec![json!({"role": "system", "content": "Be terse."})];
    for i in 0..turns {
        messages.push(json!({"role": "user", "content": format!("question {i}")}));
        messages.push(json!({"role": "assistant", "content": format!("answer {i}")}));
    }
    messages
}

/// Every turn of a conversation (each prefix of its messages), then the
/// whole one with an earlier message edited, the last replaced, tools
/// added, and the generation prompt turned off.
fn turns_and_variants() -> Vec<Value> {
    let messages = conversation(5);
    let mut bodies: Vec<Value> = (2..=messages.len())
        .map(|m| json!({"messages": messages[..m], "add_generation_prompt": true}))
        .collect();
    let whole = json!({"messages": messages, "add_generation_prompt": true});
    for at in [1, 5, messages.len() - 1] {
        let mut edited = whole.clone();
        edited["messages"][at]["content"] = json!("edited");
        bodies.push(edited);
    }
    let mut tools = whole.clone();
    tools["tools"] = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    bodies.push(tools);
    let mut no_prompt = whole.clone();
    no_prompt["add_generation_prompt"] = json!(false);
    bodies.push(no_prompt);
    // The first turns again: the memo must not serve a longer state.
    bodies.push(json!({"messages": messages[..3], "add_generation_prompt": true}));
    bodies
}

/// Templates whose message loop the memo resumes.
const RESUMABLE: &[&str] = &[
    // A plain loop, a generation prompt after it.
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\
     {% if add_generation_prompt %}<assistant>{% endif %}",
    // The system message taken out, the loop over the rest (Llama 3.1).
    "{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}\
     {% set messages = messages[1:] %}{% else %}{% set sys = '' %}{% endif %}\
     [{{ sys }}]{% for m in messages %}{{ loop.index }}:{{ m.content }};{% endfor %}",
    // A namespace the iterations update, `loop.first` and `loop.last`.
    "{% set ns = namespace(n=0, last='') %}{% for m in messages %}\
     {% if loop.first %}^{% endif %}{% set ns.n = ns.n + 1 %}{% set ns.last = m.role %}\
     {{ ns.n }}{{ m.content }}{% if loop.last %}${% endif %}{% endfor %}{{ ns.last }}",
    // Neighbours.
    "{% for m in messages %}{% if loop.previtem is defined %}{{ loop.previtem.role }}{% endif %}\
     >{{ m.content }}<{% if loop.nextitem is defined %}{{ loop.nextitem.role }}{% endif %}\
     {% endfor %}",
    // Context values read by the iterations: tools and a flag.
    "{% for m in messages %}{% if tools %}T{% endif %}{{ m.content }}\
     {% if add_generation_prompt %}+{% endif %}{% endfor %}",
    // A variable set before the loop from the last message: read by the
    // iterations, so in the key (the memo misses when it changes).
    "{% set final = messages[-1].content %}{% for m in messages %}\
     {% if m.content == final %}*{% endif %}{{ m.content }}{% endfor %}",
    // A macro called per message.
    "{% macro show(m) %}[{{ m.role }}|{{ m.content | trim }}]{% endmacro %}\
     {% for m in messages %}{{ show(m) }}{% endfor %}",
];

/// Templates whose iterations read what the memo cannot key on.
const NEVER_RESUMED: &[&str] = &[
    "{% for m in messages %}{{ loop.length }}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ loop.revindex }}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ messages[-1].content }}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ messages | length }}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ strftime_now('%Y') }}{{ m.content }}{% endfor %}",
    "{% set all = messages %}{% for m in messages %}{{ all[0].content }}{{ m.content }}{% endfor %}",
];

#[test]
fn turns_render_as_a_cold_rendering_and_minijinja() {
    for source in RESUMABLE {
        let three = Three::new(source, SpecialTokens::default());
        for body in turns_and_variants() {
            three.check(&body);
        }
        assert!(three.hits() > 0, "never resumed: {source}");
    }
}

#[test]
fn iterations_reading_what_cannot_be_keyed_are_never_resumed() {
    for source in NEVER_RESUMED {
        let three = Three::new(source, SpecialTokens::default());
        for body in turns_and_variants() {
            three.check(&body);
        }
        assert_eq!(three.hits(), 0, "resumed: {source}");
    }
}

#[test]
fn shipped_templates_resume_and_agree() {
    for family in TemplateFamily::ALL {
        let special = SpecialTokens {
            bos: family.bos_token().map(str::to_owned),
            eos: Some(family.eos_token().to_owned()),
            ..SpecialTokens::default()
        };
        let three = Three::new(family.template(), special);
        for body in turns_and_variants() {
            three.check(&body);
        }
        assert!(three.hits() > 0, "{family:?} never resumed");
    }
}

#[test]
fn the_memo_stays_within_its_bound() {
    let bound = 256 * 1024;
    let template = ChatTemplate::new(
        RESUMABLE[0],
        SpecialTokens::default(),
        RenderLimits::default(),
        Arc::new(FixedClock(0)),
    )
    .expect("a template")
    .with_render_memo(bound);
    for i in 0..500 {
        let mut messages = conversation(4);
        messages[1]["content"] = json!(format!("{i} {}", "x".repeat(2000)));
        let request = ChatRequest::new(&Value::Array(messages)).expect("a request");
        template.render(&request).expect("renders");
        let stats = template.render_memo_stats().expect("a memo");
        assert!(stats.bytes <= bound, "{} over {bound}", stats.bytes);
    }
}

#[test]
fn threads_share_the_memo() {
    let three = Arc::new(Three::new(RESUMABLE[2], SpecialTokens::default()));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let three = Arc::clone(&three);
            std::thread::spawn(move || {
                for _ in 0..20 {
                    for body in turns_and_variants() {
                        three.check(&body);
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("no panic");
    }
    assert!(three.hits() > 0);
}
