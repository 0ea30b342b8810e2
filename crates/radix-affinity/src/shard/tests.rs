use super::memory::block_size;
use super::owner::Owner;
use super::*;
use crate::symbol::UnitProbe;

/// Inserts under shared access, making room as the tree does.
fn insert(shard: &mut Shard<u8>, text: &str, tenant: u32, now: u64) {
    loop {
        match shard.insert(&UnitProbe(text.as_bytes()), tenant, now) {
            Inserted::Done { .. } => return,
            Inserted::NeedRoom { .. } => shard.make_room(tenant),
        }
    }
}

fn root_child(shard: &Shard<u8>, key: u8) -> u32 {
    shard.node(ROOT).view().child(u32::from(key)).unwrap()
}

#[test]
fn blocks_are_rounded_to_four_size_classes_per_power_of_two() {
    let cases = [
        (0, 0),
        (1, 16),
        (16, 16),
        (17, 32),
        (128, 128),
        (129, 160),
        (1024, 1024),
        (1025, 1280),
        (1030, 1280),
        (1281, 1536),
        (2048, 2048),
        (3 << 20, 3 << 20),
        ((3 << 20) + 1, (7 << 19)),
    ];
    for (size, block) in cases {
        assert_eq!(block_size(size), block, "block of {size} bytes");
    }
    // Never less than asked, never a quarter more above 128 bytes.
    for size in 129..70_000u64 {
        let block = block_size(size);
        assert!(block >= size && block * 4 <= size * 5, "{size} -> {block}");
    }
}

#[test]
fn a_zeroed_chunk_holds_empty_nodes() {
    let chunk = node_chunk::<u8>(16);
    let empty = Node::<u8>::empty(0);
    let fields = |n: &Node<u8>| {
        let view = n.view_owned();
        (
            n.version.load(Ordering::Relaxed),
            n.generation.load(Ordering::Relaxed),
            n.inline_owner.load(Ordering::Relaxed),
            n.label_cap.load(Ordering::Relaxed),
            view.parent,
            view.symbols,
            view.label.len(),
            view.children.len(),
            n.owners_owned().len(),
            n.contents_bytes(),
        )
    };
    for node in chunk.iter() {
        assert_eq!(fields(node), fields(&empty));
    }
}

#[test]
fn node_is_two_cache_lines_with_the_walk_in_the_first() {
    assert_eq!(std::mem::size_of::<Node<u8>>(), 128);
    assert_eq!(std::mem::size_of::<Node<u32>>(), 128);
    assert_eq!(std::mem::align_of::<Node<u8>>(), 128);
    assert_eq!(std::mem::offset_of!(Node<u8>, owner), 64);
}

#[test]
fn many_nodes_with_slot_reuse() {
    const N: usize = 1536;
    // A tenant's size is the number of distinct prefixes of its texts.
    fn prefixes<'a>(texts: impl Iterator<Item = &'a String>) -> u64 {
        let mut set = std::collections::HashSet::new();
        for text in texts {
            for end in 1..=text.len() {
                set.insert(&text[..end]);
            }
        }
        set.len() as u64
    }
    let mut shard: Shard<u8> = Shard::new(0, Arc::new(Accounts::new(None)));
    let texts: Vec<String> = (0..N).map(|i| format!("a{i:05}")).collect();
    for (i, text) in texts.iter().enumerate() {
        insert(&mut shard, text, (i % 3) as u32, 1);
    }
    assert!(shard.slots_used() > N, "{} slots", shard.slots_used());
    shard.check().unwrap();
    let of = |t: usize| prefixes(texts.iter().skip(t).step_by(3));
    assert_eq!(shard.size_of(0), of(0));
    assert_eq!(shard.remove_tenant(1), of(1));
    shard.check().unwrap();
    // Freed slots are reused.
    let slots = shard.slots_used();
    for text in texts.iter().skip(1).step_by(3) {
        insert(&mut shard, text, 3, 2);
    }
    shard.check().unwrap();
    assert_eq!(shard.size_of(3), of(1));
    assert_eq!(shard.slots_used(), slots);
}

#[test]
fn freed_slots_are_reused_with_a_new_generation() {
    let mut shard: Shard<u8> = Shard::new(0, Arc::new(Accounts::new(None)));
    insert(&mut shard, "abc", 0, 1);
    let node = root_child(&shard, b'a');
    let generation = shard.node(node).generation.load(Ordering::Relaxed);
    assert_eq!(shard.remove_tenant(0), 3);
    insert(&mut shard, "xy", 1, 2);
    let reused = root_child(&shard, b'x');
    assert_eq!(reused, node, "the freed slot is reused");
    assert_ne!(
        shard.node(reused).generation.load(Ordering::Relaxed),
        generation
    );
    // A candidate collected before the reuse is recognised as stale.
    let stale = Candidate {
        stamp: 1,
        tenant: 0,
        shard: 0,
        node,
        generation,
    };
    assert!(matches!(shard.evict(stale), Evicted::Stale));
    assert_eq!(shard.size_of(1), 2);
    shard.check().unwrap();
}

#[test]
fn split_copies_the_shorter_side_and_keeps_stamps() {
    let mut shard: Shard<u8> = Shard::new(0, Arc::new(Accounts::new(None)));
    insert(&mut shard, "abcdefgh", 0, 1);
    let node = root_child(&shard, b'a');
    let buf = shard.node(node).label.load(Ordering::Relaxed);
    // Upper part shorter: the lower node keeps the buffer.
    insert(&mut shard, "abx", 1, 2);
    let mid = root_child(&shard, b'a');
    assert_ne!(mid, node);
    let lower = shard.node(node).view();
    assert_eq!(lower.label, b"cdefgh");
    assert_eq!(lower.parent, mid);
    assert_eq!(shard.node(node).label.load(Ordering::Relaxed), buf);
    assert_eq!(shard.node(mid).view().label, b"ab");
    let upper = shard.node(mid).owners();
    assert_eq!(upper.owner(0).map(Owner::stamp), Some(1));
    assert_eq!(upper.owner(0).map(Owner::held), Some(1));
    assert_eq!(upper.owner(1).map(Owner::held), Some(1));
    // Lower part shorter: the upper node keeps the buffer.
    insert(&mut shard, "abcdefgz", 2, 3);
    let kept = shard.node(ROOT).view().child(u32::from(b'a')).unwrap();
    let cdefg = shard.node(kept).view().child(u32::from(b'c')).unwrap();
    assert_eq!(shard.node(cdefg).view().label, b"cdefg");
    assert_eq!(shard.node(cdefg).label.load(Ordering::Relaxed), buf);
    assert_eq!(shard.node(node).view().label, b"h");
    shard.check().unwrap();
    assert_eq!(
        (shard.size_of(0), shard.size_of(1), shard.size_of(2)),
        (8, 3, 8)
    );
}

#[test]
fn arena_growth_keeps_every_node() {
    let mut shard: Shard<u8> = Shard::new(0, Arc::new(Accounts::new(None)));
    let texts: Vec<String> = (0..200).map(|i| format!("k{i}-{}", i * 7)).collect();
    for text in &texts {
        insert(&mut shard, text, 0, 1);
    }
    assert!(shard.nodes.capacity() >= 200);
    shard.check().unwrap();
    for text in &texts {
        let end = shard.walk(&UnitProbe(text.as_bytes()), |_| true);
        assert_eq!(end.matched, text.len(), "{text}");
    }
}
