//! Where a shared secret comes from: a file or an environment variable (exactly one). Reading
//! it is `kvroute_runtime::token`'s (I/O stays out of this crate).

use crate::ConfigError;

/// Where a token comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// A file (trailing whitespace, e.g. the newline of `echo`, is ignored).
    File(String),
    /// An environment variable.
    Env(String),
}

impl TokenSource {
    /// The source the keys `token_file` and `token_env` of one section name: exactly one of
    /// them. The error's path is relative to the section (`token_file`).
    pub fn from_keys(
        token_file: Option<&str>,
        token_env: Option<&str>,
    ) -> Result<Self, ConfigError> {
        match (token_file, token_env) {
            (Some(path), None) => Ok(TokenSource::File(path.to_owned())),
            (None, Some(name)) => Ok(TokenSource::Env(name.to_owned())),
            _ => Err(ConfigError::at(
                "token_file",
                "give exactly one of token_file or token_env",
            )),
        }
    }

    /// The key that named this source (where an error loading it is reported).
    pub fn key(&self) -> &'static str {
        match self {
            TokenSource::File(_) => "token_file",
            TokenSource::Env(_) => "token_env",
        }
    }
}

/// A section that is only a token source (`query_auth:`, `node_agents:`).
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawTokenSource {
    /// File holding the token (trailing whitespace ignored).
    pub token_file: Option<String>,
    /// Environment variable holding the token (instead of `token_file`).
    pub token_env: Option<String>,
}

impl RawTokenSource {
    /// The source named: exactly one of the two keys.
    pub fn source(&self) -> Result<TokenSource, ConfigError> {
        TokenSource::from_keys(self.token_file.as_deref(), self.token_env.as_deref())
    }
}
