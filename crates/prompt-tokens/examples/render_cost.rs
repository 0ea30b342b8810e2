//! What a chat template costs to render, apart from parsing and
//! tokenizing: each family's template on conversations of 1, 6 and 24
//! messages (a system prompt, then user and assistant turns of about 80
//! bytes), and a one-line loop (`{% for m in messages %}{{ m.content }}`)
//! as the floor any template pays per message. Prints one JSON line per
//! template: microseconds per rendering at each size, and the fixed and
//! per-message parts fitted from the 1- and 24-message figures.
//!
//! ```sh
//! cargo run --release -p prompt-tokens --example render_cost -- [ITERATIONS [TEMPLATE [MESSAGES]]]
//! valgrind --tool=callgrind --collect-atstart=no \
//!     --toggle-collect='prompt_tokens::template::ChatTemplate::render' \
//!     target/release/examples/render_cost 2000 harmony 6
//! ```
//!
//! `TEMPLATE` (`floor`, `chatml`, `llama3`, `mistral`, `harmony`) and
//! `MESSAGES` restrict the run to one template and one size, for
//! callgrind: its total over the run divided by `ITERATIONS` × 1.1 (the
//! warm-up is a tenth more) gives instructions per rendering.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use prompt_tokens::{
    ChatRequest, ChatTemplate, FixedClock, RenderLimits, SpecialTokens, templates,
};

/// The message counts rendered.
const SIZES: [usize; 3] = [1, 6, 24];

/// The one-line loop: what minijinja costs per message before a template
/// does anything of its own.
const FLOOR: &str = "{% for m in messages %}{{ m.content }}{% endfor %}";

/// A chat request body of `messages` messages.
fn body(messages: usize) -> String {
    let mut list = vec![
        r#"{"role":"system","content":"You are a helpful assistant for an operations team."}"#
            .to_owned(),
    ];
    for turn in 1..messages {
        let role = if turn % 2 == 1 { "user" } else { "assistant" };
        list.push(format!(
            r#"{{"role":"{role}","content":"Turn {turn}: the p99 latency of engine 2 rose to 180 ms after the deploy; is its cache cold?"}}"#
        ));
    }
    format!(r#"{{"model":"m","messages":[{}]}}"#, list.join(","))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let iterations: u32 = args
        .next()
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(20_000);
    let only_template = args.next();
    let sizes: Vec<usize> = match args.next() {
        Some(n) => vec![n.parse()?],
        None => SIZES.to_vec(),
    };
    let special = SpecialTokens {
        bos: Some("<s>".to_owned()),
        eos: Some("</s>".to_owned()),
        ..SpecialTokens::default()
    };
    let sources = [
        ("floor", FLOOR),
        ("chatml", templates::CHATML),
        ("llama3", templates::LLAMA3),
        ("mistral", templates::MISTRAL),
        ("harmony", templates::HARMONY),
    ];
    if let Some(name) = &only_template
        && !sources.iter().any(|(known, _)| known == name)
    {
        return Err(
            format!("template {name}: expected floor, chatml, llama3, mistral or harmony").into(),
        );
    }
    let requests = sizes
        .iter()
        .map(|&n| ChatRequest::from_json(body(n).as_bytes()))
        .collect::<Result<Vec<_>, _>>()?;
    for (name, source) in sources {
        if only_template.as_deref().is_some_and(|only| only != name) {
            continue;
        }
        let template = ChatTemplate::new(
            source,
            special.clone(),
            RenderLimits::default(),
            Arc::new(FixedClock(1_764_000_000)),
        )?;
        let mut us = Vec::with_capacity(sizes.len());
        for request in &requests {
            // Warm up, then time.
            for _ in 0..iterations / 10 {
                black_box(template.render(black_box(request))?);
            }
            let started = Instant::now();
            for _ in 0..iterations {
                black_box(template.render(black_box(request))?);
            }
            us.push(started.elapsed().as_secs_f64() * 1e6 / f64::from(iterations));
        }
        let figures = sizes
            .iter()
            .zip(&us)
            .map(|(n, us)| format!("\"{n}\":{us:.2}"))
            .collect::<Vec<_>>()
            .join(",");
        let fit = if sizes.len() > 1 {
            let (first, last) = (us[0], us[us.len() - 1]);
            let per_message = (last - first) / (sizes[sizes.len() - 1] - sizes[0]) as f64;
            format!(
                ",\"fixed_us\":{:.2},\"per_message_us\":{per_message:.3}",
                first - per_message * sizes[0] as f64
            )
        } else {
            String::new()
        };
        println!("{{\"template\":\"{name}\",\"us_per_render\":{{{figures}}}{fit}}}");
    }
    Ok(())
}
