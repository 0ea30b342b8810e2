//! The reference router: `cargo run --release --example router`.
//!
//! With no worker flags it will start simulated engines in-process and route
//! to them; with vllm-router's flags it will front real engines. The command
//! line lands with the reference-router issue; until then this program says
//! so and exits.

fn main() {
    println!(
        "affinity-router {}: the reference router is not built yet; \
         see README.md for what each crate already provides.",
        env!("CARGO_PKG_VERSION")
    );
}
