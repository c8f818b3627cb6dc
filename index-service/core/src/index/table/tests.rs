use super::*;

fn table() -> HolderTable {
    HolderTable::new(KeyHasherBuilder::random())
}

fn holders_of(table: &HolderTable, key: u64, slots: usize) -> (Vec<u64>, Vec<u64>) {
    let words = SlotSet::words_for(slots);
    let (mut present, mut gpu) = (vec![0; words], vec![0; words]);
    let hash = table.hasher.mix(key);
    table
        .storage()
        .mark(table.holder_word(key, hash), &mut present, &mut gpu);
    (present, gpu)
}

#[test]
fn entries_pack_four_to_a_line() {
    assert_eq!(size_of::<Entry>(), 16);
    assert_eq!(size_of::<Line>(), 64);
    for holding in [
        Holding::Vacant,
        Holding::One(Holder {
            slot: Slot::MAX,
            media: MediaSet::only(Medium::Other),
        }),
        Holding::Narrow(MAX_ARENA_INDEX - 1),
        Holding::Wide(12345),
    ] {
        assert_eq!(Holding::decode(holding.encode()), holding);
    }
}

/// The same add/remove sequence in every representation: slots `low < mid < high` all
/// below 64 (bitset words) or not (sorted list), shrinking to a single inline holder.
fn add_and_remove_media(low: Slot, mid: Slot, high: Slot) {
    let mut table = table();
    let key = 42;
    let hash = table.hasher.mix(key);
    table.add(key, hash, mid, Medium::Gpu);
    table.add(key, hash, mid, Medium::Cpu);
    table.add(key, hash, low, Medium::Gpu);
    table.add(key, hash, high, Medium::Storage);
    assert_eq!(table.holdings(), 3);
    let both = MediaSet::only(Medium::Gpu).with(Medium::Cpu);
    assert_eq!(table.media_of(key, hash, mid), both);
    let slots = usize::from(high) + 1;
    let mut expected = (
        vec![0; SlotSet::words_for(slots)],
        vec![0; SlotSet::words_for(slots)],
    );
    for slot in [low, mid, high] {
        SlotSet::set_in(&mut expected.0, slot);
    }
    SlotSet::set_in(&mut expected.1, low);
    SlotSet::set_in(&mut expected.1, mid);
    assert_eq!(holders_of(&table, key, slots), expected);

    let removal = table.remove(key, hash, mid, Some(Medium::Gpu));
    let kept = Removal {
        was_held: true,
        slot_gone: false,
        set_empty: false,
    };
    assert_eq!(removal, kept);
    assert!(!table.remove(key, hash, mid, Some(Medium::Gpu)).was_held);
    let removal = table.remove(key, hash, mid, Some(Medium::Cpu));
    let gone = Removal {
        slot_gone: true,
        ..kept
    };
    assert_eq!(removal, gone);
    assert_eq!(table.remove(key, hash, high - 1, None), NOT_HELD);
    assert_eq!(table.remove(key, hash, low, None), gone);
    let word = Holding::decode(table.holder_word(key, hash).0);
    let media = MediaSet::only(Medium::Storage);
    assert_eq!(word, Holding::One(Holder { slot: high, media }));
    let removal = table.remove(key, hash, high, None);
    let emptied = Removal {
        set_empty: true,
        ..gone
    };
    assert_eq!(removal, emptied);
    assert_eq!((table.len(), table.memory_bytes()), (0, 0));
}

#[test]
fn add_and_remove_media_per_slot() {
    add_and_remove_media(1, 3, 7);
    add_and_remove_media(0, 3, 63);
    add_and_remove_media(1, 3, 70);
    add_and_remove_media(1, 64, 300);
}

#[test]
fn representation_follows_the_slots() {
    let mut table = table();
    let (key, hash) = (7, table.hasher.mix(7));
    let holding = |table: &HolderTable| Holding::decode(table.holder_word(key, hash).0);
    table.add(key, hash, 5, Medium::Gpu);
    table.add(key, hash, 9, Medium::Cpu);
    assert!(matches!(holding(&table), Holding::Narrow(_)));
    table.add(key, hash, 100, Medium::Gpu);
    assert!(matches!(holding(&table), Holding::Wide(_)));
    assert!(table.remove(key, hash, 100, None).slot_gone);
    assert!(matches!(holding(&table), Holding::Narrow(_)));
    assert!(table.remove(key, hash, 5, Some(Medium::Gpu)).slot_gone);
    let media = MediaSet::only(Medium::Cpu);
    assert_eq!(holding(&table), Holding::One(Holder { slot: 9, media }));
}

/// Many keys with colliding probe runs: every key stays findable through growth, deletion
/// (backward shifts) and shrinking, and memory returns to zero.
#[test]
fn churn_keeps_every_key_findable() {
    let mut table = table();
    let keys: Vec<u64> = (0..5_000u64).map(|k| k.wrapping_mul(0x9E37_79B9)).collect();
    for (n, &key) in keys.iter().enumerate() {
        let hash = table.hasher.mix(key);
        table.add(key, hash, (n % 3) as Slot, Medium::Gpu);
        if n % 5 == 0 {
            table.add(key, hash, 40, Medium::Cpu);
        }
    }
    assert_eq!(table.len(), keys.len());
    assert_eq!(table.holdings(), keys.len() + keys.len().div_ceil(5));
    for (n, &key) in keys.iter().enumerate() {
        let hash = table.hasher.mix(key);
        let expected = if n % 2 == 0 {
            MediaSet::only(Medium::Gpu)
        } else {
            MediaSet::default()
        };
        if n % 2 == 0 {
            assert_eq!(table.media_of(key, hash, (n % 3) as Slot), expected);
        } else {
            table.remove(key, hash, (n % 3) as Slot, None);
            table.remove(key, hash, 40, None);
            assert_eq!(table.media_of(key, hash, (n % 3) as Slot), expected);
        }
    }
    for (n, &key) in keys.iter().enumerate().filter(|(n, _)| n % 2 == 0) {
        let hash = table.hasher.mix(key);
        assert_eq!(
            table.media_of(key, hash, (n % 3) as Slot),
            MediaSet::only(Medium::Gpu),
            "{n}"
        );
        table.remove(key, hash, (n % 3) as Slot, None);
        table.remove(key, hash, 40, None);
    }
    assert_eq!(
        (table.len(), table.holdings(), table.memory_bytes()),
        (0, 0, 0)
    );
}
