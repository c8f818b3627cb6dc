//! The `kvroute-agent` process: how `kvroute_runtime::main` runs it (config file, reloaded when
//! it changes; ready file `admin=ADDR`; shutdown).

use std::net::SocketAddr;

use kvroute_runtime::process::{BoxError, Component, ConfigFile, Running, ServerArgs, StartError};

use crate::{Agent, AgentConfig};

/// The agent as a process: `kvroute-agent --config agent.yaml`.
#[derive(Debug)]
pub struct Process;

impl ConfigFile for AgentConfig {
    fn from_yaml(text: &str) -> Result<Self, kvroute_config::ConfigError> {
        AgentConfig::from_yaml(text)
    }

    fn log_format(&self) -> kvroute_config::LogFormat {
        self.log_format
    }
}

impl Component for Process {
    const NAME: &'static str = "kvroute-agent";
    const ABOUT: &'static str =
        "kvroute agent: mirrors local vLLM KV events, streams them to kvroute-index";
    type Args = ServerArgs;
    type Config = AgentConfig;
    type Running = Agent;

    async fn start(config: AgentConfig, args: ServerArgs) -> Result<Agent, StartError> {
        // `--config` is required for the agent (clap refuses a command line without it).
        let started = match args.config {
            Some(path) => Agent::start_reloading(config, path).await,
            None => Agent::start(config).await,
        };
        started.map_err(StartError::failed)
    }
}

impl Running for Agent {
    /// `admin=ADDR` only: the agent listens for nothing else.
    fn ready_lines(&self) -> Vec<(&'static str, SocketAddr)> {
        vec![("admin", self.admin_addr())]
    }

    /// Never: the agent has no server whose loss should stop it (its admin server only
    /// observes; streams to the indexes reconnect).
    async fn failed(&mut self) -> String {
        std::future::pending().await
    }

    async fn shutdown(self) -> Result<(), BoxError> {
        Agent::shutdown(self).await;
        Ok(())
    }
}
