//! The workload generator regenerates the spec's requests bit for bit: every
//! checksum of section 5 (count, chars, UTF-8 bytes, FNV-1a 64) and the token
//! counts of W are checked against the values published in the spec.

use radix_affinity::workload::{
    self, SPEC_CHECKSUMS, SPEC_WARM_TOKENS, Variant, Workload, checksum,
};

fn check_variant(variant: Variant) {
    let w = Workload::new(variant);
    let inserts = w.inserts(workload::WARM_REQUESTS);
    let routes = w.routes(workload::LOOKUPS);
    let lookups = w.lookups(workload::LOOKUPS);
    let sets = [
        ("W", checksum(w.warm.iter().map(|r| r.text.as_str()))),
        ("I", checksum(inserts.iter().map(|r| r.text.as_str()))),
        ("L", checksum(lookups.iter().map(|r| r.text.as_str()))),
        ("R", checksum(routes.iter().map(|r| r.text.as_str()))),
    ];
    for (name, got) in sets {
        let want = SPEC_CHECKSUMS
            .iter()
            .find(|(v, n, _)| *v == variant && *n == name)
            .map(|(_, _, c)| *c);
        assert_eq!(Some(got), want, "{variant:?} set {name}");
    }
    let mut tokens = Vec::new();
    let count: usize = w
        .warm
        .iter()
        .map(|r| {
            workload::tokenize(&r.text, &mut tokens);
            tokens.len()
        })
        .sum();
    let want = SPEC_WARM_TOKENS
        .iter()
        .find(|(v, _)| *v == variant)
        .map(|(_, n)| *n);
    assert_eq!(Some(count), want, "{variant:?} tokens of W");
    // Shape: hot lookups have warm prompts, about 20 % are cold.
    let cold = lookups.iter().filter(|l| !l.hot).count();
    assert!((18_000..22_000).contains(&cold), "{cold} cold lookups");
}

#[test]
fn ascii_sets_match_the_spec_checksums() {
    check_variant(Variant::Ascii);
}

#[test]
fn unicode_sets_match_the_spec_checksums() {
    check_variant(Variant::Unicode);
}

#[test]
fn primitives_match_the_spec() {
    // P(rank 0) = 0.20652 per the spec: the first threshold is 0.20652 * 2^64.
    let p0 = workload::ZIPF_THRESHOLDS[0] as f64 / 2f64.powi(64);
    assert!((p0 - 0.20652).abs() < 1e-5);
    assert_eq!(workload::ZIPF_THRESHOLDS[255], u64::MAX);
    // below() takes the high half of the 128-bit product.
    let mut a = workload::SplitMix64(1);
    let mut b = workload::SplitMix64(1);
    let x = a.next_u64();
    assert_eq!(b.below(10), ((u128::from(x) * 10) >> 64) as u64);
    assert!(workload::owner(0) < workload::TENANT_COUNT);
    assert_eq!(workload::tenant_name(7), "http://worker-7:8000");
}
