//! The cache size an engine reports, read from its Prometheus text: what
//! bounds the blocks the index keeps for it.

/// The KV-cache size an engine reports on its `/metrics`: the
/// `num_gpu_blocks` label of vLLM's `vllm:cache_config_info` gauge (the
/// largest, when several engines of a data-parallel server report one
/// each). `None` when no sample names a positive number of blocks (vLLM
/// writes `"None"` before the cache is sized). The text comes from a
/// network peer: every label is scanned, escapes included, and nothing is
/// allocated.
pub fn num_gpu_blocks(metrics: &str) -> Option<std::num::NonZeroUsize> {
    metrics
        .lines()
        .filter_map(|line| line.strip_prefix("vllm:cache_config_info{"))
        .filter_map(|labels| label_value(labels, "num_gpu_blocks"))
        .filter_map(|value| value.parse::<usize>().ok())
        .filter_map(std::num::NonZeroUsize::new)
        .max()
}

/// The raw value of label `name` in `labels`, the text of a sample after
/// its `{`; `None` when it is absent or the label set is malformed.
fn label_value<'a>(mut labels: &'a str, name: &str) -> Option<&'a str> {
    loop {
        labels = labels.trim_start_matches([',', ' ']);
        if labels.is_empty() || labels.starts_with('}') {
            return None;
        }
        let (label, rest) = labels.split_once('=')?;
        let value = rest.strip_prefix('"')?;
        let bytes = value.as_bytes();
        let mut at = 0;
        let end = loop {
            match bytes.get(at)? {
                b'\\' => at += 2,
                b'"' => break at,
                _ => at += 1,
            }
        };
        if label.trim() == name {
            return Some(&value[..end]);
        }
        labels = &value[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::num_gpu_blocks;

    #[test]
    fn the_cache_size_is_read_from_vllms_info_gauge() {
        let vllm = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
            # TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",\
            gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"27042\",\
            num_gpu_blocks_override=\"None\",swap_space_bytes=\"4294967296\"} 1.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n";
        assert_eq!(num_gpu_blocks(vllm).map(|n| n.get()), Some(27042));
        // Data-parallel engines report one each: the largest bounds them all.
        let ranks = "vllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"100\"} 1\n\
            vllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"120\"} 1\n";
        assert_eq!(num_gpu_blocks(ranks).map(|n| n.get()), Some(120));
    }

    #[test]
    fn hostile_or_unsized_texts_name_no_size() {
        for text in [
            "",
            "vllm:cache_config_info{num_gpu_blocks=\"None\"} 1",
            "vllm:cache_config_info{num_gpu_blocks=\"0\"} 1",
            "vllm:cache_config_info{num_gpu_blocks=\"-5\"} 1",
            "vllm:cache_config_info{num_gpu_blocks=\"99999999999999999999999\"} 1",
            "vllm:cache_config_info{num_gpu_blocks=\"12",
            "vllm:cache_config_info{num_gpu_blocks=12} 1",
            "vllm:cache_config_info{a=\"\\\"num_gpu_blocks=\\\"7\"} 1",
            "vllm:cache_config_info{a=\"x\\",
            "vllm:cache_config_infox{num_gpu_blocks=\"7\"} 1",
            "# vllm:cache_config_info{num_gpu_blocks=\"7\"} 1",
            "other{num_gpu_blocks=\"7\"} 1",
        ] {
            assert_eq!(num_gpu_blocks(text), None, "{text:?}");
        }
        // An escaped quote inside another label's value is skipped whole.
        let escaped = "vllm:cache_config_info{a=\"x\\\"y\",num_gpu_blocks=\"9\"} 1";
        assert_eq!(num_gpu_blocks(escaped).map(|n| n.get()), Some(9));
    }
}
