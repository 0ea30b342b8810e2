//! The request sets of the radix-affinity workload (`shared/workloads/
//! radix-affinity.md`, version 1), regenerated bit for bit and checked
//! against the spec's FNV-1a checksums. Used by the `decision_bench`
//! example and the criterion bench.
#![allow(dead_code)] // the bench uses a subset

/// SplitMix64, as the spec defines it.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(state: u64) -> Self {
        SplitMix64(state)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    fn zipf(&mut self) -> usize {
        let x = self.next_u64();
        ZIPF.iter().position(|&t| x < t).unwrap_or(255)
    }
}

pub(crate) const SEED: u64 = 0x5EED_0000_2026_0001;
const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 .";

/// Character variant of the workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Variant {
    Ascii,
    Unicode,
}

fn push_char(rng: &mut SplitMix64, variant: Variant, out: &mut String) {
    if variant == Variant::Unicode && rng.below(5) == 0 {
        let i = rng.below(64) as u32;
        let cp = if i < 32 {
            0x4E00 + i
        } else {
            0x1F600 + (i - 32)
        };
        out.push(char::from_u32(cp).unwrap_or('?'));
    } else {
        out.push(char::from(ALPHABET[rng.below(64) as usize]));
    }
}

fn push_chars(rng: &mut SplitMix64, variant: Variant, n: u64, out: &mut String) {
    for _ in 0..n {
        push_char(rng, variant, out);
    }
}

/// Owner tenant index (0..64) of system prompt `p`.
pub(crate) fn owner(p: usize) -> usize {
    (SplitMix64::new(p as u64).next_u64() % 64) as usize
}

/// One request: its text and system prompt id.
pub(crate) struct Request {
    pub(crate) text: String,
    pub(crate) sp: usize,
}

/// Generates the spec's sets.
pub(crate) struct Workload {
    variant: Variant,
    prompts: Vec<String>,
}

impl Workload {
    pub(crate) fn new(variant: Variant) -> Self {
        let mut rng = SplitMix64::new(SEED.wrapping_add(1));
        let prompts = (0..256)
            .map(|_| {
                let mut p = String::new();
                push_chars(&mut rng, variant, 2000, &mut p);
                p
            })
            .collect();
        Workload { variant, prompts }
    }

    /// `next_request` of the spec over `history` (earlier sets first, then
    /// this set so far).
    fn next_request(&self, rng: &mut SplitMix64, history: &[&[Request]]) -> Request {
        let u = rng.below(10);
        let len: usize = history.iter().map(|h| h.len()).sum();
        if u == 0 && len > 0 {
            let mut j = rng.below(len as u64) as usize;
            let mut base = None;
            for part in history {
                if j < part.len() {
                    base = Some(&part[j]);
                    break;
                }
                j -= part.len();
            }
            let base = base.expect("j < total history length");
            let ext = 200 + rng.below(601);
            let mut text = base.text.clone();
            push_chars(rng, self.variant, ext, &mut text);
            Request { text, sp: base.sp }
        } else {
            let sp = rng.zipf();
            let suf = 50 + rng.below(951);
            let mut text = self.prompts[sp].clone();
            push_chars(rng, self.variant, suf, &mut text);
            Request { text, sp }
        }
    }

    /// Set W (warm): 20,000 requests, stream 3.
    pub(crate) fn warm(&self) -> Vec<Request> {
        let mut rng = SplitMix64::new(SEED.wrapping_add(3));
        let mut w = Vec::with_capacity(20_000);
        for _ in 0..20_000 {
            let r = self.next_request(&mut rng, &[&w]);
            w.push(r);
        }
        w
    }

    /// The first `n` (at most 100,000) items of set R (route), stream 6.
    pub(crate) fn route(&self, warm: &[Request], n: usize) -> Vec<Request> {
        let mut rng = SplitMix64::new(SEED.wrapping_add(6));
        let mut r = Vec::with_capacity(n);
        for _ in 0..n.min(100_000) {
            let item = self.next_request(&mut rng, &[warm, &r]);
            r.push(item);
        }
        r
    }
}

/// FNV-1a 64 over each text's UTF-8 bytes followed by one 0xFF byte.
pub(crate) fn checksum(set: &[Request]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    for r in set {
        r.text.bytes().for_each(&mut feed);
        feed(0xFF);
    }
    h
}

/// The spec's checksums of the full sets: (W, R).
pub(crate) fn expected_checksums(variant: Variant) -> (u64, u64) {
    match variant {
        Variant::Ascii => (0x4943_4e34_1b7d_f95b, 0x4b9b_c8a8_03e6_75fb),
        Variant::Unicode => (0x85dd_359b_ab8f_06cc, 0xac02_3375_f247_5be6),
    }
}

/// Zipf(1.1) thresholds over 256 ranks, verbatim from the spec.
const ZIPF: [u64; 256] = [
    0x34de_af93_9423_d400,
    0x4d88_d70e_049a_e000,
    0x5d53_031c_6dc1_f000,
    0x68d4_ab53_eb9f_6400,
    0x71d5_3163_cd42_f800,
    0x7932_eed1_e2cf_7000,
    0x7f6a_8e6d_e56f_2800,
    0x84c8_c105_8bfc_5800,
    0x897f_f5c8_2dcc_4800,
    0x8db3_0ef3_1f92_b000,
    0x917b_2645_3f60_0000,
    0x94ea_e0d7_c9d8_9800,
    0x9810_762f_8473_0000,
    0x9af6_faf2_de04_f800,
    0x9da7_3b96_6b81_f000,
    0xa028_5191_6b93_4000,
    0xa280_0bf3_4fa0_d800,
    0xa4b3_3a6d_d54c_5800,
    0xa6c5_e449_19e6_a000,
    0xa8bb_715d_c9a7_9800,
    0xaa96_c922_13b5_b800,
    0xac5a_6a88_4d8f_6000,
    0xae08_7e95_b495_a800,
    0xafa2_e708_26f8_8800,
    0xb12b_4a00_83b3_d000,
    0xb2a3_1b64_6ce3_2000,
    0xb40b_a47b_3f48_d000,
    0xb566_0a28_b4bf_9800,
    0xb6b3_520f_976f_7800,
    0xb7f4_66d5_57fd_9000,
    0xb92a_1bb2_5b00_a000,
    0xba55_2f71_1c96_0000,
    0xbb76_4ef6_f49a_9000,
    0xbc8e_176b_b004_e000,
    0xbd9d_1810_e84c_7800,
    0xbea3_d3d6_ad43_b000,
    0xbfa2_c2b8_7ba0_8800,
    0xc09a_52eb_6e18_6800,
    0xc18a_e9e4_f757_f800,
    0xc274_e540_2796_2000,
    0xc358_9b86_765f_1800,
    0xc436_5ce0_3257_0800,
    0xc50e_73b0_0a42_0800,
    0xc5e1_251c_9442_4800,
    0xc6ae_b18a_4377_8800,
    0xc777_5507_dbf0_1000,
    0xc83b_47af_2531_2800,
    0xc8fa_bdfb_5960_c000,
    0xc9b5_e916_97cc_e000,
    0xca6c_f71f_7335_5000,
    0xcb20_1367_8d3c_0000,
    0xcbcf_66ac_0f73_f800,
    0xcc7b_1748_b6a0_1000,
    0xcd23_4966_0cfa_a800,
    0xcdc8_1f23_5c25_5800,
    0xce69_b8bc_ce10_a800,
    0xcf08_34ae_2553_9000,
    0xcfa3_afd2_68a2_8000,
    0xd03c_4580_d210_d000,
    0xd0d2_0fa7_493c_8000,
    0xd165_26e2_a740_3000,
    0xd1f5_a294_fc14_6000,
    0xd283_98fa_06c5_f000,
    0xd30f_1f3a_0c6c_e800,
    0xd398_497b_3504_6000,
    0xd41f_2af1_910e_8800,
    0xd4a3_d5ed_e73e_e000,
    0xd526_5beb_6620_a800,
    0xd5a6_cd9c_52d1_6800,
    0xd625_3af5_cb5b_2000,
    0xd6a1_b33a_b0f9_7000,
    0xd71c_4505_cc94_e800,
    0xd794_fe53_3df8_d800,
    0xd80b_ec89_44b2_0800,
    0xd881_1c80_701b_a000,
    0xd8f4_9a8b_42dc_3800,
    0xd966_727d_54f3_9000,
    0xd9d6_afb1_fe76_d000,
    0xda45_5d12_9430_a800,
    0xdab2_851c_3e88_9000,
    0xdb1e_31e5_7259_b800,
    0xdb88_6d23_12b7_b000,
    0xdbf1_402d_4205_c000,
    0xdc58_b403_e83c_3000,
    0xdcbe_d152_f3b8_e000,
    0xdd23_a076_5988_3000,
    0xdd87_297d_d9ab_6800,
    0xdde9_7430_8b84_d000,
    0xde4a_8810_363d_4000,
    0xdeaa_6c5c_78a9_6000,
    0xdf09_2815_c3ed_d000,
    0xdf66_c200_2be3_0800,
    0xdfc3_40a6_0ffc_9000,
    0xe01e_aa5a_9f44_d000,
    0xe079_053c_39ca_a000,
    0xe0d2_5736_b1b3_4000,
    0xe12a_a605_6df9_0800,
    0xe181_f735_70b9_c800,
    0xe1d8_5027_42d5_a800,
    0xe22d_b610_c67e_1000,
    0xe282_2dfe_f239_2800,
    0xe2d5_bcd7_75c1_1800,
    0xe328_675a_4a0f_4000,
    0xe37a_3223_2dcb_b000,
    0xe3cb_21ab_0f44_9000,
    0xe41b_3a49_64fd_6800,
    0xe46a_8035_75d3_b800,
    0xe4b8_f787_91a6_f000,
    0xe506_a43a_3b61_0000,
    0xe553_8a2b_452f_3000,
    0xe59f_ad1c_dfad_4000,
    0xe5eb_10b6_9cb9_3800,
    0xe635_b886_6699_b800,
    0xe67f_a801_6c17_6000,
    0xe6c8_e285_021e_9000,
    0xe711_6b57_7b77_0800,
    0xe759_45a8_f715_5000,
    0xe7a0_7494_2582_3800,
    0xe7e6_fb1f_05cd_b800,
    0xe82c_dc3b_9a7a_6000,
    0xe872_1ac8_96ca_2000,
    0xe8b6_b992_04cc_c000,
    0xe8fa_bb51_e48c_a000,
    0xe93e_22b0_c4b0_3800,
    0xe980_f246_54e1_f000,
    0xe9c3_2c99_f24b_9000,
    0xea04_d423_2e6e_1800,
    0xea45_eb4a_509a_d800,
    0xea86_7468_d24e_5800,
    0xeac6_71c9_d6ab_2000,
    0xeb05_e5aa_9d4e_1000,
    0xeb44_d23a_f0b3_5800,
    0xeb83_399d_9060_4800,
    0xebc1_1de8_9702_e000,
    0xebfe_8125_dcb6_8800,
    0xec3b_6553_5599_5800,
    0xec77_cc63_6cdc_6800,
    0xecb3_b83d_5c77_3800,
    0xecef_2abd_81a3_3000,
    0xed2a_25b5_ae43_e800,
    0xed64_aaed_775d_b000,
    0xed9e_bc22_80bb_0800,
    0xedd8_5b08_c5df_9800,
    0xee11_894a_e066_3000,
    0xee4a_488a_4be5_1800,
    0xee82_9a5f_a773_c800,
    0xeeba_805a_f4ea_9800,
    0xeef1_fc03_d5f5_0800,
    0xef29_0ed9_c70c_9000,
    0xef5f_ba54_5872_b000,
    0xef95_ffe3_653e_8000,
    0xefcb_e0ef_4891_3800,
    0xf001_5ed9_1105_2000,
    0xf036_7afa_b268_7000,
    0xf06b_36a7_35d5_b000,
    0xf09f_932a_e839_4000,
    0xf0d3_91cb_8754_b000,
    0xf107_33c8_6d4d_d800,
    0xf13a_7a5a_bad8_6000,
    0xf16d_66b5_8007_d000,
    0xf19f_fa05_e3d5_f800,
    0xf1d2_3573_4a6b_8000,
    0xf204_1a1f_7a35_d000,
    0xf235_a926_bfd5_8000,
    0xf266_e3a0_10f0_e800,
    0xf297_ca9d_2df4_c800,
    0xf2c8_5f2a_c2cd_0800,
    0xf2f8_a250_869f_4800,
    0xf328_9511_5a90_c000,
    0xf358_386b_679f_3000,
    0xf387_8d58_3b96_a800,
    0xf3b6_94cc_e52b_0800,
    0xf3e5_4fba_0f3d_e000,
    0xf413_bf0c_1b57_7800,
    0xf441_e3ab_3b5a_9000,
    0xf46f_be7b_8a79_9000,
    0xf49d_505d_2573_6000,
    0xf4ca_9a2c_421e_c800,
    0xf4f7_9cc1_464a_4000,
    0xf524_58f0_ddf5_7800,
    0xf550_cf8c_10ea_f800,
    0xf57d_0160_57be_a800,
    0xf5a8_ef37_b036_9800,
    0xf5d4_99d8_b123_6000,
    0xf600_0206_9dab_c800,
    0xf62b_2881_7811_a800,
    0xf656_0e06_13f3_8000,
    0xf680_b34e_280f_6800,
    0xf6ab_1910_5f8b_3800,
    0xf6d5_4000_6ac6_1800,
    0xf6ff_28cf_0fb6_f800,
    0xf728_d42a_39dc_0800,
    0xf752_42bd_09be_1000,
    0xf77b_752f_e40b_b800,
    0xf7a4_6c28_804f_8800,
    0xf7cd_2849_f743_e800,
    0xf7f5_aa34_d0c8_3000,
    0xf81d_f287_117a_0800,
    0xf846_01dc_47f5_2000,
    0xf86d_d8cd_99bc_9000,
    0xf895_77f1_cfd0_b800,
    0xf8bc_dfdd_62f3_4800,
    0xf8e4_1122_879c_c000,
    0xf90b_0c51_39a5_6800,
    0xf931_d1f7_47a3_d000,
    0xf958_62a0_5e03_8000,
    0xf97e_bed6_11d5_c800,
    0xf9a4_e71f_eb5e_5000,
    0xf9ca_dc03_705e_3800,
    0xf9f0_9e04_2e1f_0800,
    0xfa16_2da3_c33f_7000,
    0xfa3b_8b61_e943_d000,
    0xfa60_b7bc_7dec_2800,
    0xfa85_b32f_8c50_e800,
    0xfaaa_7e35_55c8_a000,
    0xfacf_1946_5a97_d800,
    0xfaf3_84d9_626c_a800,
    0xfb17_c163_84a7_8800,
    0xfb3b_cf58_3072_9800,
    0xfb5f_af29_34a9_4800,
    0xfb83_6146_c790_e800,
    0xfba6_e61f_8e63_f800,
    0xfbca_3e20_a4b1_8000,
    0xfbed_69b5_a391_0800,
    0xfc10_6948_a8ad_5000,
    0xfc33_3d42_5d25_b800,
    0xfc55_e609_fc48_b800,
    0xfc78_6405_5a27_7000,
    0xfc9a_b798_ea03_c000,
    0xfcbc_e127_c49a_3000,
    0xfcde_e113_ae47_e000,
    0xfd00_b7bd_1d0e_3000,
    0xfd22_6583_3e74_9800,
    0xfd43_eac3_fd49_b000,
    0xfd65_47dc_0744_6800,
    0xfd86_7d26_d285_e800,
    0xfda7_8afe_a2fd_0000,
    0xfdc8_71bc_8fac_9000,
    0xfde9_31b8_87d4_9000,
    0xfe09_cb49_57ff_5000,
    0xfe2a_3ec4_aef3_6000,
    0xfe4a_8c7f_228a_9800,
    0xfe6a_b4cc_346f_4000,
    0xfe8a_b7fe_56c0_1000,
    0xfeaa_9666_f09b_0800,
    0xfeca_5056_6290_9000,
    0xfee9_e61c_0afe_f000,
    0xff09_5806_4a56_c000,
    0xff28_a662_8749_2000,
    0xff47_d17d_32e0_1000,
    0xff66_d9a1_cc81_6800,
    0xff85_bf1a_e5dd_2800,
    0xffa4_8232_26c7_7800,
    0xffc3_2330_50fe_d000,
    0xffe1_a25d_43de_c000,
    0xffff_ffff_ffff_ffff,
];
