//! The normative benchmark workload of `shared/workloads/radix-affinity.md`
//! (version 1): a deterministic generator of system prompts and request sets,
//! regenerated bit for bit, plus its FNV-1a checksums and the synthetic
//! tokenisation. Used by the crate's bench and `workload` example; public so
//! another tree implementation can be measured on exactly the same requests.

/// Master seed; stream `k` is a [`SplitMix64`] seeded with `SEED + k`.
pub const SEED: u64 = 0x5EED_0000_2026_0001;

/// Number of tenants (`http://worker-{i}:8000`).
pub const TENANT_COUNT: usize = 64;
/// Number of warm (and of cold) system prompts.
pub const PROMPTS: usize = 256;
/// Characters per system prompt.
pub const PROMPT_CHARS: usize = 2000;
/// Size of the warm set W and of the insert set I.
pub const WARM_REQUESTS: usize = 20_000;
/// Size of the lookup set L and of the route set R.
pub const LOOKUPS: usize = 100_000;

const ASCII: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 .";

/// The SplitMix64 generator of the spec.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Next output.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)` by the high half of a 128-bit product (one draw).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Stream `k` of the spec.
    pub fn stream(k: u64) -> Self {
        Self(SEED.wrapping_add(k))
    }
}

/// Zipf(1.1) thresholds over 256 ranks, verbatim from section 6 of the spec.
pub const ZIPF_THRESHOLDS: [u64; 256] = [
    0x34deaf939423d400,
    0x4d88d70e049ae000,
    0x5d53031c6dc1f000,
    0x68d4ab53eb9f6400,
    0x71d53163cd42f800,
    0x7932eed1e2cf7000,
    0x7f6a8e6de56f2800,
    0x84c8c1058bfc5800,
    0x897ff5c82dcc4800,
    0x8db30ef31f92b000,
    0x917b26453f600000,
    0x94eae0d7c9d89800,
    0x9810762f84730000,
    0x9af6faf2de04f800,
    0x9da73b966b81f000,
    0xa02851916b934000,
    0xa2800bf34fa0d800,
    0xa4b33a6dd54c5800,
    0xa6c5e44919e6a000,
    0xa8bb715dc9a79800,
    0xaa96c92213b5b800,
    0xac5a6a884d8f6000,
    0xae087e95b495a800,
    0xafa2e70826f88800,
    0xb12b4a0083b3d000,
    0xb2a31b646ce32000,
    0xb40ba47b3f48d000,
    0xb5660a28b4bf9800,
    0xb6b3520f976f7800,
    0xb7f466d557fd9000,
    0xb92a1bb25b00a000,
    0xba552f711c960000,
    0xbb764ef6f49a9000,
    0xbc8e176bb004e000,
    0xbd9d1810e84c7800,
    0xbea3d3d6ad43b000,
    0xbfa2c2b87ba08800,
    0xc09a52eb6e186800,
    0xc18ae9e4f757f800,
    0xc274e54027962000,
    0xc3589b86765f1800,
    0xc4365ce032570800,
    0xc50e73b00a420800,
    0xc5e1251c94424800,
    0xc6aeb18a43778800,
    0xc7775507dbf01000,
    0xc83b47af25312800,
    0xc8fabdfb5960c000,
    0xc9b5e91697cce000,
    0xca6cf71f73355000,
    0xcb2013678d3c0000,
    0xcbcf66ac0f73f800,
    0xcc7b1748b6a01000,
    0xcd2349660cfaa800,
    0xcdc81f235c255800,
    0xce69b8bcce10a800,
    0xcf0834ae25539000,
    0xcfa3afd268a28000,
    0xd03c4580d210d000,
    0xd0d20fa7493c8000,
    0xd16526e2a7403000,
    0xd1f5a294fc146000,
    0xd28398fa06c5f000,
    0xd30f1f3a0c6ce800,
    0xd398497b35046000,
    0xd41f2af1910e8800,
    0xd4a3d5ede73ee000,
    0xd5265beb6620a800,
    0xd5a6cd9c52d16800,
    0xd6253af5cb5b2000,
    0xd6a1b33ab0f97000,
    0xd71c4505cc94e800,
    0xd794fe533df8d800,
    0xd80bec8944b20800,
    0xd8811c80701ba000,
    0xd8f49a8b42dc3800,
    0xd966727d54f39000,
    0xd9d6afb1fe76d000,
    0xda455d129430a800,
    0xdab2851c3e889000,
    0xdb1e31e57259b800,
    0xdb886d2312b7b000,
    0xdbf1402d4205c000,
    0xdc58b403e83c3000,
    0xdcbed152f3b8e000,
    0xdd23a07659883000,
    0xdd87297dd9ab6800,
    0xdde974308b84d000,
    0xde4a8810363d4000,
    0xdeaa6c5c78a96000,
    0xdf092815c3edd000,
    0xdf66c2002be30800,
    0xdfc340a60ffc9000,
    0xe01eaa5a9f44d000,
    0xe079053c39caa000,
    0xe0d25736b1b34000,
    0xe12aa6056df90800,
    0xe181f73570b9c800,
    0xe1d8502742d5a800,
    0xe22db610c67e1000,
    0xe2822dfef2392800,
    0xe2d5bcd775c11800,
    0xe328675a4a0f4000,
    0xe37a32232dcbb000,
    0xe3cb21ab0f449000,
    0xe41b3a4964fd6800,
    0xe46a803575d3b800,
    0xe4b8f78791a6f000,
    0xe506a43a3b610000,
    0xe5538a2b452f3000,
    0xe59fad1cdfad4000,
    0xe5eb10b69cb93800,
    0xe635b8866699b800,
    0xe67fa8016c176000,
    0xe6c8e285021e9000,
    0xe7116b577b770800,
    0xe75945a8f7155000,
    0xe7a0749425823800,
    0xe7e6fb1f05cdb800,
    0xe82cdc3b9a7a6000,
    0xe8721ac896ca2000,
    0xe8b6b99204ccc000,
    0xe8fabb51e48ca000,
    0xe93e22b0c4b03800,
    0xe980f24654e1f000,
    0xe9c32c99f24b9000,
    0xea04d4232e6e1800,
    0xea45eb4a509ad800,
    0xea867468d24e5800,
    0xeac671c9d6ab2000,
    0xeb05e5aa9d4e1000,
    0xeb44d23af0b35800,
    0xeb83399d90604800,
    0xebc11de89702e000,
    0xebfe8125dcb68800,
    0xec3b655355995800,
    0xec77cc636cdc6800,
    0xecb3b83d5c773800,
    0xecef2abd81a33000,
    0xed2a25b5ae43e800,
    0xed64aaed775db000,
    0xed9ebc2280bb0800,
    0xedd85b08c5df9800,
    0xee11894ae0663000,
    0xee4a488a4be51800,
    0xee829a5fa773c800,
    0xeeba805af4ea9800,
    0xeef1fc03d5f50800,
    0xef290ed9c70c9000,
    0xef5fba545872b000,
    0xef95ffe3653e8000,
    0xefcbe0ef48913800,
    0xf0015ed911052000,
    0xf0367afab2687000,
    0xf06b36a735d5b000,
    0xf09f932ae8394000,
    0xf0d391cb8754b000,
    0xf10733c86d4dd800,
    0xf13a7a5abad86000,
    0xf16d66b58007d000,
    0xf19ffa05e3d5f800,
    0xf1d235734a6b8000,
    0xf2041a1f7a35d000,
    0xf235a926bfd58000,
    0xf266e3a010f0e800,
    0xf297ca9d2df4c800,
    0xf2c85f2ac2cd0800,
    0xf2f8a250869f4800,
    0xf32895115a90c000,
    0xf358386b679f3000,
    0xf3878d583b96a800,
    0xf3b694cce52b0800,
    0xf3e54fba0f3de000,
    0xf413bf0c1b577800,
    0xf441e3ab3b5a9000,
    0xf46fbe7b8a799000,
    0xf49d505d25736000,
    0xf4ca9a2c421ec800,
    0xf4f79cc1464a4000,
    0xf52458f0ddf57800,
    0xf550cf8c10eaf800,
    0xf57d016057bea800,
    0xf5a8ef37b0369800,
    0xf5d499d8b1236000,
    0xf60002069dabc800,
    0xf62b28817811a800,
    0xf6560e0613f38000,
    0xf680b34e280f6800,
    0xf6ab19105f8b3800,
    0xf6d540006ac61800,
    0xf6ff28cf0fb6f800,
    0xf728d42a39dc0800,
    0xf75242bd09be1000,
    0xf77b752fe40bb800,
    0xf7a46c28804f8800,
    0xf7cd2849f743e800,
    0xf7f5aa34d0c83000,
    0xf81df287117a0800,
    0xf84601dc47f52000,
    0xf86dd8cd99bc9000,
    0xf89577f1cfd0b800,
    0xf8bcdfdd62f34800,
    0xf8e41122879cc000,
    0xf90b0c5139a56800,
    0xf931d1f747a3d000,
    0xf95862a05e038000,
    0xf97ebed611d5c800,
    0xf9a4e71feb5e5000,
    0xf9cadc03705e3800,
    0xf9f09e042e1f0800,
    0xfa162da3c33f7000,
    0xfa3b8b61e943d000,
    0xfa60b7bc7dec2800,
    0xfa85b32f8c50e800,
    0xfaaa7e3555c8a000,
    0xfacf19465a97d800,
    0xfaf384d9626ca800,
    0xfb17c16384a78800,
    0xfb3bcf5830729800,
    0xfb5faf2934a94800,
    0xfb836146c790e800,
    0xfba6e61f8e63f800,
    0xfbca3e20a4b18000,
    0xfbed69b5a3910800,
    0xfc106948a8ad5000,
    0xfc333d425d25b800,
    0xfc55e609fc48b800,
    0xfc7864055a277000,
    0xfc9ab798ea03c000,
    0xfcbce127c49a3000,
    0xfcdee113ae47e000,
    0xfd00b7bd1d0e3000,
    0xfd2265833e749800,
    0xfd43eac3fd49b000,
    0xfd6547dc07446800,
    0xfd867d26d285e800,
    0xfda78afea2fd0000,
    0xfdc871bc8fac9000,
    0xfde931b887d49000,
    0xfe09cb4957ff5000,
    0xfe2a3ec4aef36000,
    0xfe4a8c7f228a9800,
    0xfe6ab4cc346f4000,
    0xfe8ab7fe56c01000,
    0xfeaa9666f09b0800,
    0xfeca505662909000,
    0xfee9e61c0afef000,
    0xff0958064a56c000,
    0xff28a66287492000,
    0xff47d17d32e01000,
    0xff66d9a1cc816800,
    0xff85bf1ae5dd2800,
    0xffa4823226c77800,
    0xffc3233050fed000,
    0xffe1a25d43dec000,
    0xffffffffffffffff,
];

/// A Zipf-distributed system prompt rank in `0..256`.
#[inline]
pub fn zipf(rng: &mut SplitMix64) -> usize {
    let x = rng.next_u64();
    ZIPF_THRESHOLDS.iter().position(|&t| x < t).unwrap_or(255)
}

/// The owner (tenant index) of warm system prompt `p`.
pub fn owner(p: usize) -> usize {
    (SplitMix64(p as u64).next_u64() % TENANT_COUNT as u64) as usize
}

/// Name of tenant `i`.
pub fn tenant_name(i: usize) -> String {
    format!("http://worker-{i}:8000")
}

/// Which character distribution texts are drawn from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// 64 ASCII characters.
    Ascii,
    /// 20% CJK or emoji (3 or 4 UTF-8 bytes), 80% ASCII.
    Unicode,
    /// Chat-shaped routing texts, an extension of this workspace (not in
    /// the spec, no checksum): ASCII like [`Ascii`](Variant::Ascii), every
    /// system prompt begins with `system: ` and every request's own part
    /// with `\nuser: `, as a router's routing text of a chat request does.
    /// So every text begins with the same eight characters, and the tree's
    /// first-symbol shards see all of them in one shard unless the tree is
    /// told `system: ` as a root (the `workload` example does, as the
    /// router's `cache_aware` does; `--no-roots` leaves them out).
    Chat,
}

impl Variant {
    /// Lower-case name as used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Ascii => "ascii",
            Variant::Unicode => "unicode",
            Variant::Chat => "chat",
        }
    }

    /// Every variant, in report order.
    pub const ALL: [Variant; 3] = [Variant::Ascii, Variant::Unicode, Variant::Chat];

    /// What begins a system prompt.
    fn prompt_head(self) -> &'static str {
        if self == Variant::Chat {
            "system: "
        } else {
            ""
        }
    }

    /// What begins a request's own part after its system prompt.
    fn turn_head(self) -> &'static str {
        if self == Variant::Chat {
            "\nuser: "
        } else {
            ""
        }
    }

    #[inline]
    fn push_char(self, rng: &mut SplitMix64, out: &mut String) {
        if self == Variant::Unicode && rng.below(5) == 0 {
            let i = rng.below(64) as u32;
            let code = if i < 32 {
                0x4E00 + i
            } else {
                0x1F600 + (i - 32)
            };
            out.push(char::from_u32(code).unwrap_or('?'));
        } else {
            out.push(ASCII[rng.below(64) as usize] as char);
        }
    }

    fn push_chars(self, rng: &mut SplitMix64, n: usize, out: &mut String) {
        out.reserve(n * if self == Variant::Unicode { 2 } else { 1 });
        for _ in 0..n {
            self.push_char(rng, out);
        }
    }
}

/// One request: its text and the system prompt it derives from.
#[derive(Clone, Debug)]
pub struct Request {
    /// Full request text.
    pub text: String,
    /// System prompt id (`0..256`).
    pub sp: usize,
}

/// A lookup of set L; `hot` ones have an owner, cold ones (never-inserted
/// prompts) have none.
#[derive(Clone, Debug)]
pub struct Lookup {
    /// Full request text.
    pub text: String,
    /// Prompt id (warm for hot lookups, cold otherwise).
    pub sp: usize,
    /// Whether the prompt is a warm (inserted) one.
    pub hot: bool,
}

/// The generated workload of one variant.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Character distribution.
    pub variant: Variant,
    /// Warm system prompts P.
    pub prompts: Vec<String>,
    /// Cold system prompts C (never inserted).
    pub cold_prompts: Vec<String>,
    /// Warm set W.
    pub warm: Vec<Request>,
}

impl Workload {
    /// Generates the prompts and the warm set W.
    pub fn new(variant: Variant) -> Self {
        let prompts = gen_prompts(variant, 1);
        let cold_prompts = gen_prompts(variant, 2);
        let mut w = Self {
            variant,
            prompts,
            cold_prompts,
            warm: Vec::new(),
        };
        let mut rng = SplitMix64::stream(3);
        let mut warm = Vec::with_capacity(WARM_REQUESTS);
        for _ in 0..WARM_REQUESTS {
            let r = w.next_request(&mut rng, &[], &warm);
            warm.push(r);
        }
        w.warm = warm;
        w
    }

    /// The spec's `next_request` with `history = older ++ newer`.
    fn next_request(&self, rng: &mut SplitMix64, older: &[Request], newer: &[Request]) -> Request {
        let u = rng.below(10);
        let len = older.len() + newer.len();
        if u == 0 && len > 0 {
            let j = rng.below(len as u64) as usize;
            let base = if j < older.len() {
                &older[j]
            } else {
                &newer[j - older.len()]
            };
            let ext = 200 + rng.below(601) as usize;
            let mut text = String::with_capacity(base.text.len() + ext * 2);
            text.push_str(&base.text);
            self.variant.push_chars(rng, ext, &mut text);
            Request { text, sp: base.sp }
        } else {
            let sp = zipf(rng);
            let suf = 50 + rng.below(951) as usize;
            let mut text = String::with_capacity(self.prompts[sp].len() + suf * 2);
            text.push_str(&self.prompts[sp]);
            text.push_str(self.variant.turn_head());
            self.variant.push_chars(rng, suf, &mut text);
            Request { text, sp }
        }
    }

    /// The first `n` items of a set generated from `stream` with history
    /// `W ++ items so far`.
    fn appended_set(&self, stream: u64, n: usize) -> Vec<Request> {
        let mut rng = SplitMix64::stream(stream);
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let r = self.next_request(&mut rng, &self.warm, &out);
            out.push(r);
        }
        out
    }

    /// The first `n` items of the insert set I.
    pub fn inserts(&self, n: usize) -> Vec<Request> {
        self.appended_set(4, n)
    }

    /// The first `n` items of the route set R.
    pub fn routes(&self, n: usize) -> Vec<Request> {
        self.appended_set(6, n)
    }

    /// The first `n` items of the lookup set L.
    pub fn lookups(&self, n: usize) -> Vec<Lookup> {
        let mut rng = SplitMix64::stream(5);
        (0..n)
            .map(|_| {
                if rng.below(5) == 0 {
                    let sp = zipf(&mut rng);
                    let suf = 50 + rng.below(951) as usize;
                    let mut text = self.cold_prompts[sp].clone();
                    text.push_str(self.variant.turn_head());
                    self.variant.push_chars(&mut rng, suf, &mut text);
                    Lookup {
                        text,
                        sp,
                        hot: false,
                    }
                } else {
                    let r = self.next_request(&mut rng, &self.warm, &[]);
                    Lookup {
                        text: r.text,
                        sp: r.sp,
                        hot: true,
                    }
                }
            })
            .collect()
    }
}

fn gen_prompts(variant: Variant, stream: u64) -> Vec<String> {
    let mut rng = SplitMix64::stream(stream);
    (0..PROMPTS)
        .map(|_| {
            let mut s = String::from(variant.prompt_head());
            variant.push_chars(&mut rng, PROMPT_CHARS, &mut s);
            s
        })
        .collect()
}

/// FNV-1a 64 offset basis.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64 prime.
pub const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// On-CPU nanoseconds of the calling thread (`/proc/thread-self/schedstat`
/// field 1; 0 where that file does not exist), for the measurements' CPU
/// figures.
///
/// The kernel brings that counter up to date only at scheduler events (ticks,
/// switches), so a read could lag by up to a tick; yielding first runs the
/// scheduler's accounting for this thread, which makes sub-millisecond phases
/// (tenant removal) measurable.
pub fn thread_cpu_ns() -> u64 {
    std::thread::yield_now();
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|f| f.parse().ok()))
        .unwrap_or(0)
}

/// Timing of two threads started together: measurement (d) of the spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PairTiming {
    /// Nanoseconds from the barrier's release to the end of the last thread.
    pub wall_ns: u64,
    /// Each thread's on-CPU nanoseconds over its own work.
    pub cpu_ns: [u64; 2],
}

/// Runs `work(0)` and `work(1)` on two threads that start together at a
/// barrier, as the spec's two-thread measurements do.
///
/// The barrier spins rather than sleeps, and the clock starts when it
/// releases: a sleeping barrier's wake-up, and on a virtual machine the
/// host's latency to run an idle virtual CPU again, are then not counted
/// as the work's time (they were up to a tenth of a 2-thread route loop
/// run here), and neither is spawning the threads.
pub fn run_pair(work: impl Fn(usize) + Sync) -> PairTiming {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let arrived = AtomicUsize::new(0);
    let origin = std::time::Instant::now();
    let runs: Vec<(u64, u64, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|t| {
                let (arrived, work) = (&arrived, &work);
                scope.spawn(move || {
                    arrived.fetch_add(1, Ordering::AcqRel);
                    while arrived.load(Ordering::Acquire) < 2 {
                        std::hint::spin_loop();
                    }
                    let c0 = thread_cpu_ns();
                    let start = origin.elapsed().as_nanos() as u64;
                    work(t);
                    let end = origin.elapsed().as_nanos() as u64;
                    (start, end, thread_cpu_ns() - c0)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or((0, 0, 0)))
            .collect()
    });
    let start = runs.iter().map(|r| r.0).min().unwrap_or(0);
    let end = runs.iter().map(|r| r.1).max().unwrap_or(0);
    PairTiming {
        wall_ns: end.saturating_sub(start),
        cpu_ns: [runs[0].2, runs[1].2],
    }
}

/// FNV-1a 64 of `bytes`, continuing from `hash`.
#[inline]
pub fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// Checksum of a set as in section 5: (count, chars, UTF-8 bytes, FNV-1a 64
/// over each text followed by one 0xFF byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checksum {
    /// Number of texts.
    pub n: usize,
    /// Total chars.
    pub chars: usize,
    /// Total UTF-8 bytes.
    pub bytes: usize,
    /// FNV-1a 64.
    pub fnv: u64,
}

/// Checksum of texts in order.
pub fn checksum<'a>(texts: impl IntoIterator<Item = &'a str>) -> Checksum {
    let mut sum = Checksum {
        n: 0,
        chars: 0,
        bytes: 0,
        fnv: FNV_OFFSET,
    };
    for t in texts {
        sum.n += 1;
        sum.chars += t.chars().count();
        sum.bytes += t.len();
        sum.fnv = fnv1a(fnv1a(sum.fnv, t.as_bytes()), &[0xFF]);
    }
    sum
}

/// The spec's published checksums for the full sets: (variant, set name,
/// checksum). Set names are `W`, `I`, `L`, `R`.
pub const SPEC_CHECKSUMS: [(Variant, &str, Checksum); 8] = [
    (
        Variant::Ascii,
        "W",
        Checksum {
            n: 20_000,
            chars: 51_602_055,
            bytes: 51_602_055,
            fnv: 0x4943_4e34_1b7d_f95b,
        },
    ),
    (
        Variant::Ascii,
        "I",
        Checksum {
            n: 20_000,
            chars: 51_592_055,
            bytes: 51_592_055,
            fnv: 0x20ac_b473_7b34_001c,
        },
    ),
    (
        Variant::Ascii,
        "L",
        Checksum {
            n: 100_000,
            chars: 256_844_607,
            bytes: 256_844_607,
            fnv: 0x6009_ddb4_29a7_6ff7,
        },
    ),
    (
        Variant::Ascii,
        "R",
        Checksum {
            n: 100_000,
            chars: 258_024_058,
            bytes: 258_024_058,
            fnv: 0x4b9b_c8a8_03e6_75fb,
        },
    ),
    (
        Variant::Unicode,
        "W",
        Checksum {
            n: 20_000,
            chars: 51_508_929,
            bytes: 77_313_338,
            fnv: 0x85dd_359b_ab8f_06cc,
        },
    ),
    (
        Variant::Unicode,
        "I",
        Checksum {
            n: 20_000,
            chars: 51_573_682,
            bytes: 77_411_918,
            fnv: 0x4c56_8fea_8c66_2f2f,
        },
    ),
    (
        Variant::Unicode,
        "L",
        Checksum {
            n: 100_000,
            chars: 256_855_493,
            bytes: 385_648_877,
            fnv: 0xc02e_d1fa_2cbb_e1c9,
        },
    ),
    (
        Variant::Unicode,
        "R",
        Checksum {
            n: 100_000,
            chars: 258_148_936,
            bytes: 387_496_741,
            fnv: 0xac02_3375_f247_5be6,
        },
    ),
];

/// Tokens of W under the synthetic tokenisation, per the spec.
pub const SPEC_WARM_TOKENS: [(Variant, usize); 2] =
    [(Variant::Ascii, 12_908_045), (Variant::Unicode, 12_884_698)];

/// The synthetic tokenisation: consecutive 4-char chunks, each the FNV-1a 64
/// of its UTF-8 bytes modulo 131072.
pub fn tokenize(text: &str, out: &mut Vec<u32>) {
    out.clear();
    let mut hash = FNV_OFFSET;
    let mut in_chunk = 0;
    let mut buf = [0u8; 4];
    for c in text.chars() {
        hash = fnv1a(hash, c.encode_utf8(&mut buf).as_bytes());
        in_chunk += 1;
        if in_chunk == 4 {
            out.push((hash % 131_072) as u32);
            hash = FNV_OFFSET;
            in_chunk = 0;
        }
    }
    if in_chunk > 0 {
        out.push((hash % 131_072) as u32);
    }
}
