//! Property tests of the chaining invariants.
#![allow(
    clippy::unwrap_used,
    reason = "test code: helpers outside #[test] fns panic on bad fixtures by design"
)]

use kvroute_block_keys::{Digest, HashAlgo, HashValue, KeyScheme, TokenChain, VllmHasher};
use proptest::prelude::*;

fn no_extra(_: usize) -> Option<&'static HashValue> {
    None
}

fn algo() -> impl Strategy<Value = HashAlgo> {
    prop::sample::select(HashAlgo::ALL.to_vec())
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    // Mix of small ids and ids past every pickle/CBOR width boundary.
    prop::collection::vec(prop_oneof![0u32..300, any::<u32>()], 0..200)
}

proptest! {
    #[test]
    fn chain_of_a_prefix_is_a_prefix_of_the_chain(
        algo in algo(),
        tokens in tokens(),
        cut in 0usize..200,
        block_size in 1usize..40,
    ) {
        let hasher = VllmHasher::new(algo, Some("7")).unwrap();
        let prefix = &tokens[..cut.min(tokens.len())];
        let full = hasher.chain(None, &tokens, block_size, no_extra).unwrap();
        let part = hasher.chain(None, prefix, block_size, no_extra).unwrap();
        prop_assert_eq!(&full[..part.len()], &part[..]);
        prop_assert_eq!(full.len(), tokens.len() / block_size);

        let full = TokenChain::keys(&tokens, block_size, None, None).unwrap();
        let part = TokenChain::keys(prefix, block_size, None, None).unwrap();
        prop_assert_eq!(&full[..part.len()], &part[..]);
    }

    #[test]
    fn continuing_from_a_parent_equals_the_full_chain(
        algo in algo(),
        tokens in tokens(),
        split_block in 0usize..10,
        block_size in 1usize..20,
    ) {
        let hasher = VllmHasher::new(algo, Some("")).unwrap();
        let full = hasher.chain(None, &tokens, block_size, no_extra).unwrap();
        prop_assume!(split_block < full.len());
        let parent: Digest = full[split_block];
        let rest = &tokens[(split_block + 1) * block_size..];
        let tail = hasher.chain(Some(&parent), rest, block_size, no_extra).unwrap();
        prop_assert_eq!(&full[split_block + 1..], &tail[..]);

        let keys = TokenChain::keys(&tokens, block_size, Some("a"), None).unwrap();
        let mut tail = Vec::new();
        TokenChain::keys_from_into(keys[split_block], rest, block_size, &mut tail).unwrap();
        prop_assert_eq!(&keys[split_block + 1..], &tail[..]);
    }

    #[test]
    fn token_chain_keys_differ_across_namespaces(
        tokens in prop::collection::vec(any::<u32>(), 16..64),
        a in prop::option::of("[a-z]{0,6}"),
        b in prop::option::of("[a-z]{0,6}"),
        salt_a in prop::option::of("[a-z]{1,6}"),
        salt_b in prop::option::of("[a-z]{1,6}"),
    ) {
        prop_assume!((&a, &salt_a) != (&b, &salt_b));
        let ka = TokenChain::keys(&tokens, 16, a.as_deref(), salt_a.as_deref()).unwrap();
        let kb = TokenChain::keys(&tokens, 16, b.as_deref(), salt_b.as_deref()).unwrap();
        prop_assert_ne!(ka[0], kb[0]);
        // Every later key differs too, since each depends on the first.
        prop_assert!(ka.iter().zip(&kb).all(|(x, y)| x != y));
    }

    #[test]
    fn scheme_keys_are_one_per_full_block(tokens in tokens(), block_size in 1usize..40) {
        let hasher = VllmHasher::new(HashAlgo::Sha256, None).unwrap();
        let exact = KeyScheme::VllmExact { hasher, era: kvroute_block_keys::ExtraKeysEra::From0_31 };
        for scheme in [exact, KeyScheme::TokenChain] {
            let keys = scheme.prompt_keys(&tokens, block_size, None, Some("s")).unwrap();
            prop_assert_eq!(keys.len(), tokens.len() / block_size);
        }
    }
}

#[test]
fn zero_block_size_is_an_error_not_a_panic() {
    let err = KeyScheme::TokenChain
        .prompt_keys(&[1, 2], 0, None, None)
        .unwrap_err();
    assert_eq!(err.as_label(), "zero_block_size");
    let hasher = VllmHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    assert!(hasher.chain(None, &[1, 2], 0, no_extra).is_err());
}
