//! ext-proc's request body parser: the first byte picks the endpoint, the rest is the body
//! Envoy buffered. Any input gives a parsed request or an error, never a panic.

#![no_main]

use kvroute_request::{Endpoint, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let endpoint = match selector % 5 {
        0 => Endpoint::ChatCompletions,
        1 => Endpoint::Completions,
        3 => Endpoint::Responses,
        4 => Endpoint::Messages,
        _ => Endpoint::Other,
    };
    let _ = parse(body, endpoint);
});
