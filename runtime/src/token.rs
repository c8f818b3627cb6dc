//! A shared secret (an agent's `Hello`, the query API's bearer token): loaded from a file or an
//! environment variable, compared in constant time, and never printed (`Debug` is redacted).

use std::fmt;

use kvroute_config::TokenSource;

/// The request header (gRPC metadata key) carrying a token: `authorization: Bearer <token>`.
pub const AUTHORIZATION: &str = "authorization";

/// Why a token cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file cannot be read.
    #[error("cannot read token file {path}")]
    File {
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The variable is unset or not unicode.
    #[error("environment variable {name} is not set")]
    Env {
        /// The variable.
        name: String,
    },
    /// The token is empty.
    #[error("the token from {from} is empty")]
    Empty {
        /// File path or variable name.
        from: String,
    },
}

impl TokenError {
    /// Metric/log label.
    pub fn as_label(&self) -> &'static str {
        match self {
            TokenError::File { .. } => "file",
            TokenError::Env { .. } => "env",
            TokenError::Empty { .. } => "empty",
        }
    }
}

/// A secret token.
#[derive(Clone, PartialEq, Eq)]
pub struct AgentToken(String);

impl fmt::Debug for AgentToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AgentToken(<redacted>)")
    }
}

impl AgentToken {
    /// Reads the token from its source.
    pub fn load(source: &TokenSource) -> Result<Self, TokenError> {
        let (text, from) = match source {
            TokenSource::File(path) => (
                std::fs::read_to_string(path).map_err(|source| TokenError::File {
                    path: path.clone(),
                    source,
                })?,
                path,
            ),
            TokenSource::Env(name) => (
                std::env::var(name).map_err(|_| TokenError::Env { name: name.clone() })?,
                name,
            ),
        };
        let token = text.trim_end();
        if token.is_empty() {
            return Err(TokenError::Empty { from: from.clone() });
        }
        Ok(Self(token.to_owned()))
    }

    /// A token from a literal (tests, programmatic setup).
    pub fn from_literal(token: impl Into<String>) -> Self {
        Self(token.into())
    }

    /// The secret, for putting on the wire.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Compares with a presented token in time independent of where they differ.
    pub fn matches(&self, presented: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), presented.as_bytes());
        // Fold over the longer length so timing does not reveal the matching prefix.
        let len = a.len().max(b.len());
        let mut diff = u8::from(a.len() != b.len());
        for i in 0..len {
            diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
        }
        std::hint::black_box(diff) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compares_exactly_and_never_prints() {
        let token = AgentToken::from_literal("s3cret");
        assert!(token.matches("s3cret"));
        for wrong in ["", "s3cre", "s3cret!", "S3cret", "x3cret"] {
            assert!(!token.matches(wrong), "{wrong}");
        }
        assert!(!format!("{token:?}").contains("s3cret"));
    }

    #[test]
    fn loads_from_file_and_env() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "abc\n").unwrap();
        let token = AgentToken::load(&TokenSource::File(path.display().to_string())).unwrap();
        assert!(token.matches("abc"));
        assert!(matches!(
            AgentToken::load(&TokenSource::Env("KVROUTE_TEST_SURELY_UNSET_TOKEN".into())),
            Err(TokenError::Env { .. })
        ));
    }
}
