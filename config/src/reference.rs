//! The generated configuration reference: a raw config's JSON schema rendered as markdown.
