//! kvroute-ext-proc: Envoy `ext_proc` endpoint picker (skeleton; see issue 4).
